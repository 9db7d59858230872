"""How many staging buffers a streamed component's PAGEABLE and MAPPED layers need, from the same replay
as its prefetch window (``planner.window.replay_use_s`` with the host staging ring modelled).

Pure arithmetic on the planner's facts (no device); the planner's search (``planner.search``) runs it.

Why sized here, not fixed at two: a staged layer's DMA waits for its fill, and a fill waits for the
DMA out of the bytes it overwrites, so the staging ring bounds how far the copies can run ahead
however deep the device window is. With equal layers two buffers are enough (one filled while the
other drains); an uneven stack banks the copy-bound layers' copies ahead during the compute-bound
ones, and two buffers hold only one double block ahead: FLUX-like uneven bytes with equal compute
stayed at 1.066x the bound at every depth 4-14 with two buffers, 1.010 with 4 buffers at depth 6
(``bench/sim_overlap.py --quick --uneven-uniform-compute``, pageable).

:func:`choose_staging` picks the fewest buffers (each the largest staged layer's host bytes, as
``buffers.staging_bytes`` counts them) whose replayed use is within ``WINDOW_TOLERANCE`` of the
widest ring's (one buffer per staged layer) at the same depth; never fewer than
``DEFAULT_STAGING_BUFFERS``. The search leases them only beside every pin (``planner.search``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

from offload_core.buffers import DEFAULT_STAGING_BUFFERS, RegionMap, slot_count
from offload_core.host.tier import STAGED_TIERS, HostingTier
from offload_core.planner.facts import LayerProfile, LinkFacts
from offload_core.planner.window import WINDOW_TOLERANCE, StagingReplay, copy_seconds, replay_use_s


@dataclass(frozen=True)
class StagingChoice:
    """The staging ring the planner picked for a component's staged streamed layers, and why."""

    buffers: int  # StreamingConfig.staging_buffers: the ring's bytes in largest staged layers
    buffer_bytes: int  # one buffer: the largest staged layer's host bytes
    use_s: float  # a steady use replayed with this ring
    default_use_s: float  # with DEFAULT_STAGING_BUFFERS
    widest_use_s: float  # with one buffer per staged layer

    @property
    def staging_bytes(self) -> int:
        return self.buffers * self.buffer_bytes

    def explain(self) -> str:
        return (f"staging {self.buffers} x {self.buffer_bytes / 2**20:.1f} MiB: a use replays at "
                f"{self.use_s:.4f} s ({self.default_use_s:.4f} s with {DEFAULT_STAGING_BUFFERS} buffers, "
                f"{self.widest_use_s:.4f} s with one per staged layer)")


def choose_staging(layers: Sequence[LayerProfile], tiers: Mapping[str, HostingTier], link: LinkFacts,
                   compute_s: Sequence[float], depth: int, rest_s: float = 0.0) -> StagingChoice | None:
    """The fewest staging buffers whose use at ``depth`` is within ``WINDOW_TOLERANCE`` of the widest
    ring's (every staged layer) or of unbounded staging's, whichever is slower; None: nothing staged."""
    staged = [layer for layer in layers if tiers[layer.key] in STAGED_TIERS]
    if not staged:
        return None
    buffer_bytes = RegionMap.covering((layer.layout for layer in staged), host=True).nbytes
    sizes = tuple(RegionMap.covering([layer.layout]).nbytes for layer in layers)
    window = slot_count(depth, len(layers)) * RegionMap.covering(layer.layout for layer in layers).nbytes
    computes = tuple(float(s) for s in compute_s)
    unbounded = replay_use_s(sizes, window, tuple(copy_seconds(l, tiers[l.key], link) for l in layers),
                             computes, rest_s)
    dma = tuple(layer.host_bytes / link.pinned_Bps for layer in layers)
    fill_bytes = tuple(RegionMap.covering([layer.layout], host=True).nbytes for layer in layers)
    fill_s = tuple(layer.host_bytes / link.rate(tiers[layer.key]) if tiers[layer.key] in STAGED_TIERS else 0.0
                   for layer in layers)

    def use(buffers: int) -> float:
        ring = StagingReplay(buffers * buffer_bytes, fill_bytes, fill_s)
        return replay_use_s(sizes, window, dma, computes, rest_s, ring)

    low = min(DEFAULT_STAGING_BUFFERS, len(staged))
    high = max(low, len(staged))
    default, widest = use(low), use(high)
    enough = max(unbounded, widest) * (1 + WINDOW_TOLERANCE)
    if default <= enough:
        high = low
    while low < high:  # more bytes never make a fill wait longer: bisect for the least that is enough
        mid = (low + high) // 2
        if use(mid) <= enough:
            high = mid
        else:
            low = mid + 1
    return StagingChoice(high, buffer_bytes, use(high), default, widest)
