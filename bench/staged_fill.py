"""A staging fill's host memcpy rate by copier threads, side by side in one run, as the engine splits it.

    OMP_NUM_THREADS=1 .venv/bin/python bench/staged_fill.py [--mib 256] [--threads 1 2] [--rounds 5]

Copies written pageable memory into a staging buffer (page-locked on CUDA, plain memory on CPU)
through ``offload_core.streaming.copier.FillSplitter``, the copier's own split, for each thread
count in turn, round after round (so a neighbour's load falls on every count alike), and prints
each count's best and median rate and the ratio to one thread. Run it under ``OMP_NUM_THREADS=1``
(Ray's default for a replica actor): then each ``copy_`` is one thread's memcpy and only the
copier's split adds threads. The load average before and after is printed: on shared cores the
ratio is only as good as the cores that were free.

Last line: one JSON object with ``rates_GBps`` (best per count), ``median_GBps``, ``ratio_2_over_1``.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from offload_core.host.pinned import allocate_host_buffer, free_host_buffer  # noqa: E402
from offload_core.streaming.copier import FillSplitter  # noqa: E402


def timed_copy(splitter: FillSplitter, dst: torch.Tensor, src: torch.Tensor) -> float:
    start = time.perf_counter()
    splitter.copy([(dst, src)])
    return dst.numel() / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=256, help="bytes per fill, MiB")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    nbytes = args.mib * 1024 * 1024
    cuda = torch.cuda.is_available()
    buffer = allocate_host_buffer(nbytes, pin=cuda, device=torch.device("cuda" if cuda else "cpu"))
    src = torch.empty(nbytes, dtype=torch.uint8)
    src.fill_(1)  # written: real pages
    load_before = os.getloadavg()
    splitters = {n: FillSplitter(n, f"bench-{n}") for n in args.threads}
    rates: dict[int, list[float]] = {n: [] for n in args.threads}
    try:
        for splitter in splitters.values():
            splitter.copy([(buffer.data, src)])  # warm-up: first touch, helpers started
        for _ in range(args.rounds):
            for n, splitter in splitters.items():
                rates[n].append(timed_copy(splitter, buffer.data, src))
    finally:
        for splitter in splitters.values():
            splitter.close()
        free_host_buffer(buffer)
    load_after = os.getloadavg()
    best = {n: max(r) for n, r in rates.items()}
    median = {n: statistics.median(r) for n, r in rates.items()}
    print(f"{args.mib} MiB pageable -> {'pinned' if buffer.page_locked else 'plain'} staging buffer, "
          f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')} (torch threads {torch.get_num_threads()}), "
          f"{len(os.sched_getaffinity(0))} usable cores, {args.rounds} rounds")
    print(f"load average before {load_before[0]:.2f} / after {load_after[0]:.2f}")
    for n in args.threads:
        print(f"  {n} copier threads: best {best[n] / 1e9:6.2f} GB/s, median {median[n] / 1e9:6.2f} GB/s, "
              f"x{best[n] / best[args.threads[0]]:.2f} of {args.threads[0]} (median x{median[n] / median[args.threads[0]]:.2f})")
    ratio = best[2] / best[1] if 1 in best and 2 in best else None
    print(json.dumps({
        "bench": "staged_fill", "mib": args.mib, "pinned": buffer.page_locked, "cuda": cuda,
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"), "torch_threads": torch.get_num_threads(),
        "usable_cores": len(os.sched_getaffinity(0)), "rounds": args.rounds,
        "rates_GBps": {str(n): round(best[n] / 1e9, 3) for n in args.threads},
        "median_GBps": {str(n): round(median[n] / 1e9, 3) for n in args.threads},
        "ratio_2_over_1": None if ratio is None else round(ratio, 3),
        "median_ratio_2_over_1": None if ratio is None else round(median[2] / median[1], 3),
        "load_average_before": round(load_before[0], 2), "load_average_after": round(load_after[0], 2),
    }))


if __name__ == "__main__":
    main()
