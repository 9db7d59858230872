"""Where the staged rate goes on a GPU host: the link probe's staged pipeline by chunk size, chunk
count and copier threads, beside the split memcpy alone at the same size and the host's NUMA facts.

The H200 run at 4ed5bc7 staged at 19.97 GB/s on 7 copier threads against the fill probe's best
memcpy of 41.7 GB/s (64 MiB, into pinned memory) and 54.25 GB/s of pinned DMA: 0.48 of the min,
target 0.7. A fill and the DMA out of the other chunk should overlap; 1 / (1/41.7 + 1/54.25) =
23.6 GB/s is what they give run one after the other. This says which: the memcpy alone at the
probe's 256 MiB (is 41.7 a 64 MiB figure the sustained copy never reaches?), the pipeline with more
and larger chunks (does the DMA wait for the fill?), more threads (is the split short of cores?),
and which NUMA node the GPU and this process's cores are on (a copier on the far socket crosses
the inter-socket link twice). Then the memcpy out of a page-cached file mapping, as the MAPPED tier's
fills read it, beside anonymous memory: mapped real-size Wan2.1-1.3B ran 1.27x its pageable step
through the same staging (143.7 against 113.3 ms), and the simulator has no mapped rate to go by.

    OMP_NUM_THREADS=1 python bench/staged_sweep.py          # CUDA only; last line one JSON object
"""
from __future__ import annotations

import json
import mmap
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.fill_probe import one_source_and_rotated  # noqa: E402
from offload_core.host.pinned import allocate_host_buffer, free_host_buffer  # noqa: E402
from offload_core.streaming import fill_threads  # noqa: E402
from offload_core.streaming.copier import FillSplitter  # noqa: E402
from offload_core.streaming.link import staged_bandwidth  # noqa: E402

MiB = 1 << 20
SOURCE_BYTES = 256 * MiB  # the link probe's size
CHUNKS = ((32 * MiB, 2), (32 * MiB, 4), (64 * MiB, 2), (64 * MiB, 3), (16 * MiB, 4))


def numa_facts(device: torch.device) -> dict:
    """The GPU's NUMA node (sysfs, by its PCI address), the nodes' CPU lists, this process's cores."""
    props = torch.cuda.get_device_properties(device)
    address = (f"{getattr(props, 'pci_domain_id', 0):04x}:{getattr(props, 'pci_bus_id', 0):02x}:"
               f"{getattr(props, 'pci_device_id', 0):02x}.0")
    facts: dict = {"gpu_pci": address, "affinity_cpus": len(os.sched_getaffinity(0)), "cpu_count": os.cpu_count()}
    node_file = Path("/sys/bus/pci/devices") / address / "numa_node"
    facts["gpu_numa_node"] = int(node_file.read_text()) if node_file.exists() else None
    # Every NVIDIA display/3D controller's node too (vendor 0x10de, class 0x03...), should torch not
    # report the PCI address: on a one-GPU machine that is this GPU's.
    facts["nvidia_pci_numa_nodes"] = {
        d.name: int((d / "numa_node").read_text()) for d in sorted(Path("/sys/bus/pci/devices").glob("*"))
        if (d / "vendor").exists() and (d / "vendor").read_text().strip() == "0x10de"
        and (d / "class").read_text().startswith("0x03") and (d / "numa_node").exists()}
    nodes = sorted(Path("/sys/devices/system/node").glob("node[0-9]*"))
    facts["node_cpus"] = {p.name: (p / "cpulist").read_text().strip() for p in nodes if (p / "cpulist").exists()}
    return facts


def mapped_copy_rates(dst: torch.Tensor, threads: list[int]) -> dict[str, dict[str, float]]:
    """GB/s of a split copy into ``dst`` out of a page-cached file mapping of its size, by threads: the
    first pass over a fresh mapping (each page faulted into this process) and the best of three after."""
    nbytes = dst.numel()
    anonymous = torch.zeros(nbytes, dtype=torch.uint8)  # written (memset): real pages
    rates: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory(prefix="staged-sweep-") as folder:
        path = Path(folder) / "weights.bin"
        path.write_bytes(b"\x01" * nbytes)  # written by this process: in the page cache
        for n in threads:
            splitter = FillSplitter(n, "offload-sweep")
            try:
                splitter.copy([(dst, anonymous)])  # the helpers started, dst touched
                with open(path, "rb") as file, mmap.mmap(file.fileno(), nbytes, access=mmap.ACCESS_COPY) as view:
                    src = torch.frombuffer(view, dtype=torch.uint8)  # copy-on-write: reads share the page cache
                    start = time.perf_counter()
                    splitter.copy([(dst, src)])
                    first = nbytes / (time.perf_counter() - start)
                    warm = fill_threads.split_copy_rate(dst, src, n)
                    del src  # the mapping closes only once no tensor exports it
            finally:
                splitter.close()
            rates[str(n)] = {"first_GBps": round(first / 1e9, 2), "warm_GBps": round(warm / 1e9, 2)}
            print(f"memcpy out of a file mapping, {n:>2} threads: {first / 1e9:6.2f} GB/s first pass, "
                  f"{warm / 1e9:6.2f} warm", flush=True)
    return rates


def main() -> None:
    if not torch.cuda.is_available():
        print(json.dumps({"bench": "staged_sweep", "skipped": "CUDA only"}))
        return
    device = torch.device("cuda", torch.cuda.current_device())
    cap = fill_threads.default_cap()
    probe = fill_threads.device_probe(device, cap)
    threads = sorted({probe.threads, cap, min(16, fill_threads.usable_cpus())})
    src = torch.empty(SOURCE_BYTES, dtype=torch.uint8)
    src.fill_(1)
    dst = torch.empty(SOURCE_BYTES, dtype=torch.uint8, device=device)
    pinned = allocate_host_buffer(SOURCE_BYTES, pin=True, device=device)
    rows = []
    try:
        memcpy = {n: fill_threads.split_copy_rate(pinned.data, src, n) / 1e9 for n in threads}
        # The fill probe as it was, one 64 MiB source copied again and again (the host's caches may hold
        # it: 41.7-48.0 GB/s on the H200 host against 28.3 at 1 GiB), beside the rotated slices it reads now.
        one_source = {n: one_source_and_rotated(pinned.data[:fill_threads.PROBE_BYTES], n, probe.cache_bytes)
                      for n in threads}
        mapped = mapped_copy_rates(pinned.data, threads)
        for chunk_bytes, count in CHUNKS:
            chunks = [allocate_host_buffer(chunk_bytes, pin=True, device=device) for _ in range(count)]
            try:
                for n in threads:
                    rate = staged_bandwidth(dst, src, [c.data for c in chunks], device, 3, n)
                    rows.append({"chunk_MiB": chunk_bytes // MiB, "chunks": count, "threads": n,
                                 "staged_GBps": round(rate / 1e9, 2)})
                    print(f"chunk {chunk_bytes // MiB:>3} MiB x {count}, {n:>2} threads: {rate / 1e9:6.2f} GB/s",
                          flush=True)
            finally:
                for chunk in chunks:
                    free_host_buffer(chunk)
    finally:
        free_host_buffer(pinned)
    result = {"bench": "staged_sweep", "probe_threads": probe.threads, "cap": cap,
              "probe_memcpy_GBps_64MiB": [round(r / 1e9, 2) for r in probe.rates_Bps],
              "probe_source_MiB": probe.source_bytes >> 20, "last_level_cache_MiB": probe.cache_bytes >> 20,
              "memcpy_64MiB_one_source_and_rotated": {str(n): r for n, r in one_source.items()},
              "memcpy_GBps_256MiB": {str(n): round(r, 2) for n, r in memcpy.items()},
              "mapped_memcpy_GBps_256MiB": mapped,
              "staged": rows, "best_staged_GBps": max(r["staged_GBps"] for r in rows), **numa_facts(device)}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
