"""The simulated accelerator's SMs: one pool of compute time that kernels on every stream share.

Tests and benches only (``testing.sim``'s :class:`~testing.sim.SimDevice` places every kernel here).
Streams order kernels; they do not add compute. A kernel on the copy stream (an FP8 widen) runs
on the same SMs as the layer's compute, so where compute keeps the device busy the widen's device
time adds to the step: on the H200 real-size Wan2.1-1.3B at 6 latent frames (compute-bound) ran
FP8 at 1.136x the resident step against 1.027x for bf16 pinned, about the widen's ~9.5 ms of a
~108 ms step (gpu_check at 4ed5bc7), while a simulator that let the copy stream's kernels run
beside compute for free put FP8 at the pinned step (0.996x).

The model is work-conserving and fluid: a kernel ready at ``t`` takes the SMs' free time from
``t`` on until it got its seconds, filling the gaps that kernels placed before it left (kernels
are placed in the order the host launches them, as the simulator advances). Small kernels that
leave most SMs idle (the image regime's) are still charged their whole time; that regime is
launch-bound, so the SMs have free time to give.
"""
from __future__ import annotations

import bisect


class SmTimeline:
    """Busy intervals of the SMs, disjoint and sorted; a kernel fills the free time after it is ready."""

    def __init__(self) -> None:
        self._busy: list[tuple[float, float]] = []

    @property
    def busy_s(self) -> float:
        return sum(end - start for start, end in self._busy)

    def place(self, ready: float, seconds: float) -> float:
        """Run ``seconds`` of work from ``ready`` on in the free time; returns when it ends."""
        if seconds <= 0:
            return ready
        taken: list[tuple[float, float]] = []
        at, left = ready, seconds
        index = bisect.bisect_left(self._busy, (ready, ready))
        if index and self._busy[index - 1][1] > at:  # ready inside the interval before: start at its end
            index -= 1
        while left > 0:
            nxt = self._busy[index] if index < len(self._busy) else None
            if nxt is not None and nxt[0] <= at:
                at = max(at, nxt[1])
                index += 1
                continue
            gap = (nxt[0] - at) if nxt is not None else left
            run = min(gap, left)
            taken.append((at, at + run))
            at, left = at + run, left - run
        for span in taken:
            self._insert(span)
        return at

    def forget_before(self, t: float) -> None:
        """Drop intervals that ended by ``t`` (no kernel can be ready before every host thread's clock)."""
        cut = 0
        while cut < len(self._busy) and self._busy[cut][1] <= t:
            cut += 1
        if cut:
            del self._busy[:cut]

    def _insert(self, span: tuple[float, float]) -> None:
        index = bisect.bisect_left(self._busy, span)
        self._busy.insert(index, span)
        # merge with neighbours that touch (keeps the list short: a stream's back-to-back kernels)
        lo = max(0, index - 1)
        merged = [self._busy[lo]]
        for start, end in self._busy[lo + 1:index + 2]:
            if start <= merged[-1][1]:
                merged[-1] = (merged[-1][0], max(merged[-1][1], end))
            else:
                merged.append((start, end))
        self._busy[lo:index + 2] = merged
