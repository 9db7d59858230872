"""The prefetch window a streamed component needs, from the engine's own window replayed on its layers' times.

Pure arithmetic on the planner's facts (no device): the ring's placement (``layout.WindowPlacer``)
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
bound); the cost model adds :func:`window_wait_s` (what the plan's window makes a use take beyond
the bound) to its predicted time, so a plan says what its window costs.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Mapping, Sequence

from offload_core.host.tier import STAGED_TIERS, HostingTier
from offload_core.layout import RegionMap, WindowPlacer, slot_count
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


@functools.lru_cache(maxsize=4096)  # the search asks for the same streamed set and depth again and again
def replay_use_s(sizes: tuple[int, ...], window: int, copy_s: tuple[float, ...], compute_s: tuple[float, ...],
                 rest_s: float = 0.0) -> float:
    """Seconds of a steady use of layers ``sizes`` in a ``window``-byte ring (see the module docstring)."""
    n = len(sizes)
    placer = WindowPlacer(sizes, window)
    landed: dict[int, float] = {}  # held layer -> when its copy lands
    read: list[tuple[int, int, float]] = []  # released bytes -> when their last reader's compute ends
    engine = 0.0  # when the copy engine is free

    def issue(p: int, start: int) -> None:
        nonlocal engine, read
        end = start + sizes[p]
        begin = engine
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
        placer.take(p, start)

    last = -1  # the layer issued last: in order, the held layers run from the entered one to it

    def prefetch(first: int) -> None:
        nonlocal last
        p = (last + 1) % n if landed else first  # past the held run, as the ring's scan gets there
        for _ in range(n - len(landed)):
            start = placer.fits(p)
            if start is None:
                return
            issue(p, start)
            last, p = p, (p + 1) % n

    prefetch(0)  # prepare_for_use
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
            t = max(t, landed.pop(p)) + compute_s[p]
            a, b = placer.free(p)
            read.append((a, b, t))
            prefetch((p + 1) % n)
        ends.append(t)
    return ends[-1] - ends[-2]
