"""The fill probe's host memcpy: one source copied again and again, against rotated slices out of the cache's reach.

Up to this bench's commit the fill probe (``offload_core.streaming.fill_threads``) timed one 64 MiB
source copied into one destination, again and again. On the H200's host it gave 41.7-48.0 GB/s,
where 1 GiB copies over 8 threads gave 28.3 GB/s (``../shared/measurements/h200-2026-12-04/memcpy.json``),
and staged fills, which read each layer once per step, ran at 20 GB/s. Now each copy reads the
next slice of a source several times the last-level cache (``fill_threads.source_slices``). This
times both ways, alternated, by copier threads, at the probe's size and at one the last-level cache
holds (source and destination together in a quarter of it), so the gap a cache can open is seen
on any host.

    OMP_NUM_THREADS=1 .venv/bin/python bench/fill_probe.py [--device cuda]   # last line: one JSON object
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from offload_core.host.pinned import allocate_host_buffer, free_host_buffer  # noqa: E402
from offload_core.streaming import fill_threads  # noqa: E402

MiB = 1 << 20


def one_source_and_rotated(dst: torch.Tensor, threads: int, cache_bytes: int, rounds: int = 3) -> dict[str, float]:
    """GB/s into ``dst`` on ``threads``: one source again and again, and rotated slices; best of ``rounds``
    alternated rounds (3 timed copies each), so a load that comes and goes hits both alike."""
    slices = fill_threads.source_slices(dst.numel(), cache_bytes)
    src = torch.empty(slices, dst.numel(), dtype=torch.uint8)
    src.fill_(1)  # written: real pages, not the zero page
    rotation = itertools.cycle(src.unbind(0))
    one = rotated = 0.0
    for _ in range(rounds):
        one = max(one, fill_threads.split_copy_rate(dst, src[0], threads))
        rotated = max(rotated, fill_threads.split_copy_rate(dst, rotation, threads))
    return {"one_source_GBps": round(one / 1e9, 2), "rotated_GBps": round(rotated / 1e9, 2),
            "one_over_rotated": round(one / rotated, 3), "source_MiB": slices * dst.numel() // MiB}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", help="cpu, or cuda (the destination page-locked, as the probe's)")
    args = parser.parse_args()
    device = torch.device(args.device)
    cache = fill_threads.last_level_cache_bytes()
    cap = fill_threads.default_cap()
    in_cache = max(MiB, cache // 8 // MiB * MiB)  # source + destination in a quarter of the cache
    rows = []
    for size in (fill_threads.PROBE_BYTES, in_cache):
        buffer = allocate_host_buffer(size, pin=device.type == "cuda", device=device)
        try:
            for n in range(1, cap + 1):
                row = {"size_MiB": size // MiB, "threads": n, **one_source_and_rotated(buffer.data, n, cache)}
                rows.append(row)
                print(f"{row['size_MiB']:>4} MiB, {n} threads: one source {row['one_source_GBps']:6.2f} GB/s, "
                      f"rotated over {row['source_MiB']} MiB {row['rotated_GBps']:6.2f} GB/s "
                      f"({row['one_over_rotated']:.3f}x)", flush=True)
        finally:
            free_host_buffer(buffer)
    print(json.dumps({"bench": "fill_probe", "device": str(device), "last_level_cache_MiB": cache // MiB,
                      "cap": cap, "rows": rows}))


if __name__ == "__main__":
    main()
