"""How many threads the staging copier splits each fill over: a cap, and a probe of this host's memcpy.

Runs in the replica process, once per device and cap (cached): the link probe
(``offload_core.streaming.link``) and the engine's copier ask it, so both use the same count.

The cap keeps replicas sharing a node from oversubscribing its cores: at most ``DEFAULT_CAP``
threads, and no more than the cores this process may run on divided among the node's replicas
(the replica's side of the node ledger says how many share it). Within the cap the probe takes
the fewest threads that reach ``GOOD_ENOUGH`` of the best rate: where the memory bus saturates
with two threads, four would only burn two more cores.

The probe copies out of memory the caches do not hold, as a fill does (a layer of a multi-GB host
copy, read once per step): each copy reads the next slice of a source several times the host's
last-level cache (``source_slices``). On the H200's host one 64 MiB source copied again and again
gave 41.7-48.0 GB/s (4ed5bc7, fcfd650), where 1 GiB copies over 8 threads gave 28.3 GB/s
(``../shared/measurements/h200-2026-12-04/memcpy.json``): the thread count and the rate the plan
prices staged tiers against were a cache's, not the fills'.
"""
from __future__ import annotations

import functools
import itertools
import logging
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch

from offload_core.host.pinned import allocate_host_buffer, free_host_buffer
from offload_core.streaming.copier import FillSplitter

logger = logging.getLogger(__name__)

# Eight: on an H200 host split copies reached 5.2 / 10.1 / 18.5 / 28.3 GB/s pageable -> pinned on
# 1 / 2 / 4 / 8 threads against a 55 GB/s link; the simulator with those rates (bench/sim_overlap.py,
# the h200 cases) puts real-size Wan2.1-1.3B pageable at 6 frames at 1.53x the pinned step on four
# threads and 1.02x on eight. Eight of sixteen cores still leave compute its launch thread; replicas
# sharing a node divide the cores first (default_cap).
DEFAULT_CAP = 8
# 64 MiB: 13 ms at one thread's 5 GB/s, so a probe of eight counts x four copies takes ~0.5 s at
# worst; long against a share handoff (tens of us), short beside a replica's start.
PROBE_BYTES = 64 * 1024 * 1024
GOOD_ENOUGH = 0.9  # fewest threads within 10 % of the best rate
# At most 16 slices (1 GiB of pageable memory, for the probe's ~1 s): 2 x 384 MiB of L3 (an EPYC
# 9004 host's, the largest seen on GPU hosts) passes between two reads of one slice with 13.
MAX_SOURCE_SLICES = 16
CPU_SYSFS = Path("/sys/devices/system/cpu")


def usable_cpus() -> int:
    """Cores this process may run on (its affinity, which a container or taskset narrows)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def default_cap(replicas: int = 1, cpus: int | None = None) -> int:
    """min(DEFAULT_CAP, cores // replicas sharing them), at least 1."""
    if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1:
        raise ValueError(f"replicas sharing the node must be an int >= 1, got {replicas!r}")
    return max(1, min(DEFAULT_CAP, (cpus or usable_cpus()) // replicas))


@dataclass(frozen=True)
class FillProbe:
    """Split-copy rates into the probe's destination, by thread count 1..cap, and the count chosen."""

    threads: int
    rates_Bps: tuple[float, ...]  # [n - 1]: n threads
    source_bytes: int = 0  # what the copies rotated over (slices of the destination's size)
    cache_bytes: int = 0  # the last-level cache it was sized against (0: unknown)

    @property
    def rate_Bps(self) -> float:
        """The rate at the chosen count."""
        return self.rates_Bps[self.threads - 1]

    def explain(self) -> str:
        rates = ", ".join(f"{n + 1}: {r / 1e9:.1f}" for n, r in enumerate(self.rates_Bps))
        cache = (f"{self.cache_bytes >> 20} MiB of last-level cache" if self.cache_bytes
                 else "a last-level cache sysfs does not give (the most slices)")
        return (f"staging fills split over {self.threads} copier threads (host memcpy GB/s by threads: {rates}; "
                f"fewest within {GOOD_ENOUGH:.0%} of the best; copies rotated over {self.source_bytes >> 20} MiB "
                f"against {cache}, so none read a cached source)")


def last_level_cache_bytes(cpus: set[int] | None = None, root: Path = CPU_SYSFS) -> int:
    """Bytes of the highest-level caches the cores ``cpus`` (this process's affinity) share, summed
    over their instances (an EPYC's L3 is one per core complex); 0 where sysfs does not say."""
    cpus = set(os.sched_getaffinity(0)) if cpus is None and hasattr(os, "sched_getaffinity") else cpus
    caches: dict[tuple[int, str], int] = {}  # (level, the cores sharing it) -> bytes
    for index in sorted(root.glob("cpu[0-9]*/cache/index[0-9]*")):
        cpu = int(index.parent.parent.name[3:])
        if cpus is not None and cpu not in cpus:
            continue
        try:
            kind = (index / "type").read_text().strip()
            level = int((index / "level").read_text())
            size = _size_bytes((index / "size").read_text())
            shared = (index / "shared_cpu_list").read_text().strip()
        except (OSError, ValueError):
            continue
        if kind != "Instruction":
            caches[(level, shared)] = size
    top = max((level for level, _ in caches), default=None)
    return sum(size for (level, _), size in caches.items() if level == top)


def _size_bytes(text: str) -> int:
    """sysfs cache sizes: "32768K", "1024K", "32M"."""
    text = text.strip()
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:].upper(), 1)
    return int(text.rstrip("KkMmGg")) * scale


def source_slices(slice_bytes: int, cache_bytes: int) -> int:
    """How many slices of ``slice_bytes`` a probe's copies rotate over, so twice the cache's bytes
    pass between two reads of one slice (read and written bytes both take cache lines): at least 2.
    ``cache_bytes`` 0, a cache sysfs does not give, takes the most: 1 GiB outgrows any cache seen on a
    GPU host. gVisor, which the H200 machines run under, serves cpuN/topology and no cache folders
    (pkg/sentry/fsimpl/sys/sys.go, cpuDir): there two slices would have sat in the L3."""
    if cache_bytes <= 0:
        return MAX_SOURCE_SLICES
    return max(2, min(MAX_SOURCE_SLICES, math.ceil(2 * cache_bytes / slice_bytes) + 1))


def split_copy_rate(dst: torch.Tensor, src: torch.Tensor | Iterator[torch.Tensor], threads: int,
                    repeats: int = 3) -> float:
    """Best of ``repeats`` timings of a source copied into ``dst`` split over ``threads``, bytes per second.

    ``src``: one tensor, copied each time, or an iterator of tensors of ``dst``'s size, each copy the
    next (the probe's slices, out of the caches' reach)."""
    sources = itertools.repeat(src) if isinstance(src, torch.Tensor) else src
    splitter = FillSplitter(threads, "offload-fill-probe")
    try:
        splitter.copy([(dst, next(sources))])  # warm-up: first touch, the helpers started
        best = float("inf")
        for _ in range(repeats):
            pair = [(dst, next(sources))]
            start = time.perf_counter()
            splitter.copy(pair)
            best = min(best, time.perf_counter() - start)
    finally:
        splitter.close()
    return dst.numel() * dst.element_size() / best


def probe(dst: torch.Tensor, cap: int, repeats: int = 3, cache_bytes: int | None = None) -> FillProbe:
    """Rates of written pageable memory split-copied into ``dst`` (uint8, 1-D) by 1..``cap`` threads,
    each copy out of the next of ``source_slices`` slices (``cache_bytes``: None reads sysfs)."""
    if cap < 1:
        raise ValueError(f"copier thread cap must be >= 1, got {cap}")
    cache_bytes = last_level_cache_bytes() if cache_bytes is None else cache_bytes
    slices = source_slices(dst.numel(), cache_bytes)
    src = torch.empty(slices, dst.numel(), dtype=dst.dtype)
    src.fill_(1)  # written: real pages, not the zero page
    sources = itertools.cycle(src.unbind(0))  # one rotation across every thread count's copies
    rates = tuple(split_copy_rate(dst, sources, n, repeats) for n in range(1, cap + 1))
    best = max(rates)
    threads = next(n for n, rate in enumerate(rates, start=1) if rate >= GOOD_ENOUGH * best)
    return FillProbe(threads, rates, src.numel() * src.element_size(), cache_bytes)


def device_probe_host_bytes(cache_bytes: int | None = None) -> int:
    """Host memory :func:`device_probe` holds while it runs: its destination and the slices it rotates
    over (``cache_bytes``: None reads sysfs)."""
    cache_bytes = last_level_cache_bytes() if cache_bytes is None else cache_bytes
    return PROBE_BYTES * (1 + source_slices(PROBE_BYTES, cache_bytes))


@functools.lru_cache(maxsize=None)
def device_probe(device: torch.device, cap: int) -> FillProbe:
    """:func:`probe` into a page-locked buffer for ``device`` (pageable where the lock is refused), once."""
    buffer = allocate_host_buffer(PROBE_BYTES, pin=True, device=device)
    try:
        found = probe(buffer.data, cap)
    finally:
        free_host_buffer(buffer)
    logger.info("fill threads for %s (cap %d, %s destination): %s", device, cap,
                "pinned" if buffer.page_locked else "pageable", found.explain())
    return found
