"""The prefetch window a streamed component needs, from the engine's own window replayed on its layers' times.

Pure arithmetic on the planner's facts (no device): the ring's placement (``buffers.WindowPlacer``)
and its issue rule (a layer's exit releases its bytes and issues the copies after it, in order,
while their bytes are free; wrapping into the next use) run on one copy engine (copies in issue
order, each after the last compute that read the bytes it overwrites) and one compute stream (a
layer after its own copy and the layer before it). The launch thread is taken to run ahead: it
only issues asynchronous copies from pinned memory (staged layers included).

Why a window counted in bytes, sized here: with equal layers depth 1 already keeps the copy engine
as busy as ``max(sum copy, sum compute)`` allows. An uneven stack does not: FLUX's double blocks
carry twice the bytes of its single blocks while computing alike, so the double blocks are
copy-bound and the single ones compute-bound, and a step balanced overall only reaches its bound
if the copies of the double blocks are banked ahead while the single blocks compute. How far the
copy engine may run ahead is the window: depth 1-2 holds 2-6 single blocks, where the deficit of
13 double blocks needs about 9 (``bench/sim_overlap.py --uneven-uniform-compute``: 1.11-1.17x the
bound at depth 1-2 before the planner sized the window).

:func:`choose_window` picks the smallest depth whose replayed use is within ``WINDOW_TOLERANCE`` of
the bound ``max(sum copy, sum compute)`` (or of the widest window's use, when no window reaches the
bound). With a :class:`StagingReplay` (``planner.staging_ring``) the host staging ring is replayed
too, and the copies are issued at the launch thread's exits, which run ahead of the GPU: a fill
not done with two layers banked waits for a later exit, one with fewer is waited for, and between
uses (the caller synchronises) no exit issues anything; this reproduces the simulator's figures for
2-4 buffers exactly (``bench/sim_overlap.py``, overheads off). The cost model adds :func:`window_wait_s` (what the plan's window makes a use take beyond
the bound) to its predicted time, so a plan says what its window costs.

Runs in whichever process plans: ``offload-serve plan`` and each stage replica (through ``cluster/replica/plan.py``).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Mapping, Sequence

from offload_core.buffers import RegionMap, WindowPlacer, slot_count
from offload_core.host.tier import STAGED_TIERS, HostingTier
from offload_core.planner.facts import LayerProfile, LinkFacts

# A window within 1 % of the widest one's use: deeper would buy under 1 % for one more largest
# layer on the device. The simulator's overheads (copy latency, launch time, +-20 % copier jitter)
# add 1-3 % on top of the replay, inside bench/sim_overlap.py's 5 % target.
WINDOW_TOLERANCE = 0.01
# Uses replayed: the first starts from prepare_for_use's burst; the last is the steady state.
_USES = 3


@dataclass(frozen=True)
class WindowChoice:
    """The window the planner picked for a component's streamed layers, and why."""

    depth: int  # layers ahead of the running one, in largest layers (StreamingConfig.prefetch_depth)
    window_bytes: int  # slot_count(depth) x the largest streamed layer's regions
    use_s: float  # a steady use replayed with this window
    shallow_use_s: float  # with depth 1
    bound_s: float  # max(sum copy, sum compute + non-layer compute): no window does better

    @property
    def shallow_wait_s(self) -> float:
        """Per use, what a use at depth 1 takes beyond the bound (copies the window could not bank ahead)."""
        return _beyond(self.shallow_use_s, self.bound_s)

    @property
    def wait_s(self) -> float:
        return _beyond(self.use_s, self.bound_s)


def copy_seconds(layer: LayerProfile, tier: HostingTier, link: LinkFacts) -> float:
    """One copy of ``layer`` from ``tier``: the DMA, or for a staged tier the slower stage of the
    memcpy into staging (at the tier's rate) and the DMA out of it."""
    dma = layer.host_bytes / link.pinned_Bps
    if tier in STAGED_TIERS:
        return max(dma, layer.host_bytes / link.rate(tier))
    return dma


def choose_window(layers: Sequence[LayerProfile], tiers: Mapping[str, HostingTier], link: LinkFacts,
                  compute_s: Sequence[float], rest_s: float = 0.0) -> WindowChoice:
    """The smallest depth whose steady use is within ``WINDOW_TOLERANCE`` of the bound (or of the
    widest window's use, when even that misses the bound)."""
    sizes, region, copies, computes = _inputs(layers, tiers, link, compute_s)
    n = len(sizes)
    bound = max(sum(copies), sum(computes) + rest_s)
    if n < 2 or not any(computes):  # nothing to bank copies behind, or one layer: depth 1
        return WindowChoice(1, slot_count(1, n) * region, bound, bound, bound)

    def use(depth: int) -> float:
        return replay_use_s(sizes, slot_count(depth, n) * region, copies, computes, rest_s)

    shallow = use(1)
    enough = bound * (1 + WINDOW_TOLERANCE)
    low, high = 1, 1
    if shallow > enough:
        low, high = 2, n - 1
        enough = max(enough, use(high) * (1 + WINDOW_TOLERANCE))
    while low < high:  # a wider window does not make a use slower: bisect for the least that is enough
        mid = (low + high) // 2
        if use(mid) <= enough:
            high = mid
        else:
            low = mid + 1
    return WindowChoice(high, slot_count(high, n) * region, use(high), shallow, bound)


def window_wait_s(layers: Sequence[LayerProfile], tiers: Mapping[str, HostingTier], link: LinkFacts,
                  compute_s: Sequence[float], depth: int, rest_s: float = 0.0) -> float:
    """Per use, what ``depth``'s window makes a use take beyond the bound ``max(sum copy, sum compute)``."""
    sizes, region, copies, computes = _inputs(layers, tiers, link, compute_s)
    n = len(sizes)
    if n < 2 or not any(computes):
        return 0.0
    bound = max(sum(copies), sum(computes) + rest_s)
    return _beyond(replay_use_s(sizes, slot_count(depth, n) * region, copies, computes, rest_s), bound)


def _beyond(use_s: float, bound_s: float) -> float:
    """``use_s - bound_s``, with the sums' rounding (parts in 10^9) read as none."""
    extra = use_s - bound_s
    return extra if extra > 1e-9 * bound_s else 0.0


def _inputs(layers, tiers, link, compute_s):
    sizes = tuple(RegionMap.covering([layer.layout]).nbytes for layer in layers)
    region = RegionMap.covering(layer.layout for layer in layers).nbytes
    copies = tuple(copy_seconds(layer, tiers[layer.key], link) for layer in layers)
    return sizes, region, copies, tuple(float(s) for s in compute_s)


@dataclass(frozen=True)
class StagingReplay:
    """The host staging ring as the replay runs it (``streaming/staging.py``): a ``ring_bytes`` byte
    ring the copier fills in order, each layer's ``fill_bytes`` contiguous after the last (at 0 if it
    does not fit before the end), a fill waiting for the DMA out of the bytes it overwrites; the
    layer's DMA waits for its fill. ``fill_s``: each layer's memcpy (0: not staged)."""

    ring_bytes: int
    fill_bytes: tuple[int, ...]
    fill_s: tuple[float, ...]


class _Copier:
    """The replay's host copier: fills in issue order into the staging ring."""

    def __init__(self, staging: StagingReplay):
        self.staging, self.free_at, self.head = staging, 0.0, 0
        self.out: list[tuple[int, int, float]] = []  # bytes copied out -> when that DMA lands

    def fill(self, p: int, commit: bool = True) -> tuple[int, int, float]:
        """Layer ``p``'s fill (the next in order): its bytes in the ring and when it ends."""
        size = self.staging.fill_bytes[p]
        start = self.head if self.head + size <= self.staging.ring_bytes else 0
        end, begin, kept = start + size, self.free_at, []
        for a, b, landed in self.out:
            if a < end and start < b:
                begin = max(begin, landed)  # the copier waits for the copy out of these bytes
                kept += [r for r in ((a, start, landed), (end, b, landed)) if r[0] < r[1]]
            else:
                kept.append((a, b, landed))
        if commit:
            self.out, self.head = kept, end
            self.free_at = begin + self.staging.fill_s[p]
        return start, end, begin + self.staging.fill_s[p]


@functools.lru_cache(maxsize=4096)  # the search asks for the same streamed set and depth again and again
def replay_use_s(sizes: tuple[int, ...], window: int, copy_s: tuple[float, ...], compute_s: tuple[float, ...],
                 rest_s: float = 0.0, staging: StagingReplay | None = None) -> float:
    """Seconds of a steady use of layers ``sizes`` in a ``window``-byte ring (see the module docstring);
    with ``staging``, staged layers' copies are the DMA alone (``copy_s``) after their fill."""
    n = len(sizes)
    placer = WindowPlacer(sizes, window)
    landed: dict[int, float] = {}  # held layer -> when its copy lands
    read: list[tuple[int, int, float]] = []  # released bytes -> when their last reader's compute ends
    engine = 0.0  # when the copy engine is free
    copier = _Copier(staging) if staging is not None else None

    def issue(p: int, start: int, now: float = 0.0) -> None:
        nonlocal engine, read
        end = start + sizes[p]
        begin = max(engine, now)
        fill = None
        if copier is not None and staging.fill_s[p] > 0:
            fill = copier.fill(p)
            begin = max(begin, fill[2])
        kept = []
        for a, b, done in read:
            if a < end and start < b:
                begin = max(begin, done)  # the copy waits for every reader of the bytes it overwrites
                if a < start:
                    kept.append((a, start, done))
                if end < b:
                    kept.append((end, b, done))
            else:
                kept.append((a, b, done))
        read = kept
        engine = landed[p] = begin + copy_s[p]
        if fill is not None:
            copier.out.append((fill[0], fill[1], engine))
        placer.take(p, start)

    last = -1  # the layer issued last: in order, the held layers run from the entered one to it

    def prefetch(first: int, now: float) -> float:
        """Issue from ``first`` at ``now``; returns when the launch thread goes on (after its waits)."""
        nonlocal last
        p = (last + 1) % n if landed else first  # past the held run, as the ring's scan gets there
        for _ in range(n - len(landed)):
            start = placer.fits(p)
            if start is None:
                return now
            if copier is not None and staging.fill_s[p] > 0:
                filled = copier.fill(p, commit=False)[2]
                if filled > now and len(landed) > 1:
                    return now  # ring.py: a fill not done with two layers banked is issued by a later exit
                now = max(now, filled)  # with one banked the launch thread waits for the fill
            issue(p, start, now)
            last, p = p, (p + 1) % n
        return now

    launch = prefetch(0, 0.0)  # prepare_for_use
    t, ends = 0.0, []
    for _ in range(_USES):
        t += rest_s
        for p in range(n):
            if p not in landed:  # a cold entry (the engine's out-of-order path): not reached in order
                for held in list(landed):
                    del landed[held]
                    placer.free(held)
                issue(p, placer.fits(p))
                last = p
            t = max(t, landed.pop(p), launch) + compute_s[p]
            a, b = placer.free(p)
            read.append((a, b, t))
            # With staging the launch thread's exits issue the copies, ahead of the GPU: a fill not
            # done by then waits for a later exit, and none comes between uses (the caller syncs).
            launch = prefetch((p + 1) % n, launch if copier is not None else t)
        ends.append(t)
        launch = max(launch, t)
    return ends[-1] - ends[-2]
