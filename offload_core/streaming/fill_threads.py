"""How many threads the staging copier splits each fill over: a cap, and a probe of this host's memcpy.

Runs in the replica process, once per device and cap (cached): the link probe
(``offload_core.streaming.link``) and the engine's copier ask it, so both use the same count.

The cap keeps replicas sharing a node from oversubscribing its cores: at most ``DEFAULT_CAP``
threads, and no more than the cores this process may run on divided among the node's replicas
(the replica's side of the node ledger says how many share it). Within the cap the probe takes
the fewest threads that reach ``GOOD_ENOUGH`` of the best rate: where the memory bus saturates
with two threads, four would only burn two more cores.
"""
from __future__ import annotations

import functools
import logging
import os
import time
from dataclasses import dataclass

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

    @property
    def rate_Bps(self) -> float:
        """The rate at the chosen count."""
        return self.rates_Bps[self.threads - 1]

    def explain(self) -> str:
        rates = ", ".join(f"{n + 1}: {r / 1e9:.1f}" for n, r in enumerate(self.rates_Bps))
        return (f"staging fills split over {self.threads} copier threads (host memcpy GB/s by threads: {rates}; "
                f"fewest within {GOOD_ENOUGH:.0%} of the best)")


def split_copy_rate(dst: torch.Tensor, src: torch.Tensor, threads: int, repeats: int = 3) -> float:
    """Best of ``repeats`` timings of ``src`` copied into ``dst`` split over ``threads``, bytes per second."""
    splitter = FillSplitter(threads, "offload-fill-probe")
    try:
        splitter.copy([(dst, src)])  # warm-up: first touch, the helpers started
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            splitter.copy([(dst, src)])
            best = min(best, time.perf_counter() - start)
    finally:
        splitter.close()
    return dst.numel() * dst.element_size() / best


def probe(dst: torch.Tensor, cap: int, repeats: int = 3) -> FillProbe:
    """Rates of written pageable memory split-copied into ``dst`` (uint8, 1-D) by 1..``cap`` threads."""
    if cap < 1:
        raise ValueError(f"copier thread cap must be >= 1, got {cap}")
    src = torch.empty(dst.numel(), dtype=dst.dtype)
    src.fill_(1)  # written: real pages, not the zero page
    rates = tuple(split_copy_rate(dst, src, n, repeats) for n in range(1, cap + 1))
    best = max(rates)
    threads = next(n for n, rate in enumerate(rates, start=1) if rate >= GOOD_ENOUGH * best)
    return FillProbe(threads, rates)


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
