"""The simulated machine's rates and host costs (:class:`SimLink`), and the copier's slow stretches.

Tests and benches only (``testing.sim``'s :class:`~testing.sim.SimDevice` runs by them). Besides
bandwidths, what the H200 runs showed a step pays on the host: a memcpy rate per copier thread
(split fills add threads up to the memory bus's rate), a launch cost per kernel on the thread that
launches it (a layer of many small kernels is launch-bound when their launches outlast their
device time), and the device time of an FP8 widen.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

from offload_core.host.tier import HostingTier


@dataclass(frozen=True)
class SlowStretch:
    """The copier at ``factor`` x its speed while its clock is in [start_s, end_s) (a busy memory bus)."""

    start_s: float
    end_s: float
    factor: float = 0.5

    def __post_init__(self) -> None:
        if not (0 < self.factor <= 1 and 0 <= self.start_s <= self.end_s):
            raise ValueError(f"SlowStretch needs 0 <= start <= end and 0 < factor <= 1, got {self}")


@dataclass(frozen=True)
class SimLink:
    """The simulated machine's rates. Defaults: PCIe Gen4 x16 (the brief's 25 / 10 GB/s), no overheads."""

    pinned_Bps: float = 25e9  # DMA from page-locked memory
    pageable_Bps: float = 10e9  # through the driver's own staging buffer, host thread blocked
    mapped_Bps: float = 10e9  # a page-cached file mapping goes through the same driver staging
    host_memcpy_Bps: float = 12e9  # one host thread's memcpy (pageable -> pinned staging buffer)
    # The most host memcpy all copier threads reach together (the memory bus); 0: n threads, n x one's.
    host_memcpy_max_Bps: float = 0.0
    launch_s: float = 0.0  # host time to launch one kernel or issue one copy, on the launching thread
    copy_latency_s: float = 0.0  # copy-engine time every host->device copy pays besides its bytes
    copier_jitter: float = 0.0  # each host memcpy takes x U(1 - j, 1 + j), seeded by ``seed``
    copier_slow: SlowStretch | None = None
    seed: int = 0
    # Device bytes an FP8 widen writes per second (SimDevice.charge_widen); 0: the widen takes no
    # device time (launches and host syncs are charged all the same).
    widen_Bps: float = 0.0

    def __post_init__(self) -> None:
        for name in ("pinned_Bps", "pageable_Bps", "mapped_Bps", "host_memcpy_Bps"):
            if not getattr(self, name) > 0:
                raise ValueError(f"SimLink.{name} must be > 0, got {getattr(self, name)!r}")
        for name in ("launch_s", "copy_latency_s", "host_memcpy_max_Bps", "widen_Bps"):
            if getattr(self, name) < 0:
                raise ValueError(f"SimLink.{name} must be >= 0, got {getattr(self, name)!r}")
        if not 0 <= self.copier_jitter < 1:
            raise ValueError(f"SimLink.copier_jitter must be in [0, 1), got {self.copier_jitter!r}")

    def h2d_Bps(self, source: HostingTier) -> float:
        return {HostingTier.PINNED: self.pinned_Bps, HostingTier.PAGEABLE: self.pageable_Bps,
                HostingTier.MAPPED: self.mapped_Bps}[source]

    def memcpy_Bps(self, threads: int = 1) -> float:
        """Host memcpy rate of one fill split over ``threads`` copier threads."""
        rate = threads * self.host_memcpy_Bps
        return min(rate, self.host_memcpy_max_Bps) if self.host_memcpy_max_Bps else rate

    def memcpy_s(self, nbytes: int, start: float, rng: random.Random, threads: int = 1) -> float:
        """Seconds of a host memcpy of ``nbytes`` over ``threads`` starting at ``start`` on the copier's clock."""
        seconds = nbytes / self.memcpy_Bps(threads)
        if self.copier_jitter:
            seconds *= rng.uniform(1 - self.copier_jitter, 1 + self.copier_jitter)
        slow = self.copier_slow
        if slow is not None and start < slow.end_s and start + seconds > slow.start_s:
            # The part inside the stretch runs at factor x speed: integrate the work over time.
            before = max(0.0, slow.start_s - start)
            inside = min(seconds - before, (slow.end_s - max(start, slow.start_s)) * slow.factor)
            after = seconds - before - inside
            seconds = before + inside / slow.factor + after
        return seconds
