"""The buffers streamed layers move through, and their sizes: the device prefetch window (ring slots, where
each layer goes in it, how many copies a request makes), per-dtype regions of one allocation, the pinned
staging buffers of PAGEABLE and MAPPED layers and the device landing buffers of FP8 layers.

Pure bookkeeping over :mod:`offload_core.layout`'s layer layouts, shared by the engine's ring
(``streaming.ring``, in the replica process) and the planner, which replays it to price a plan.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

import torch

from offload_core.layout import LayerLayout, align_up

# Pinned staging buffers per streamer for its PAGEABLE and MAPPED layers: the host copier fills
# one while the DMA drains the other. In the simulator (25 GB/s DMA, 12 GB/s memcpy) two reach every
# steady-state ratio <= 1.05 at depth 1 and 2; one would serialise memcpy and DMA.
DEFAULT_STAGING_BUFFERS = 2
LANDING_BUFFERS = 2  # FP8 landing buffers per streamer: DMA into one while the other is widened


def slot_count(prefetch_depth: int, n_streamed: int) -> int:
    """Device slots of the prefetch ring: the running layer plus ``prefetch_depth`` ahead, but never
    more than there are streamed layers (a second slot for the same layer would hold it twice)."""
    return min(prefetch_depth + 1, n_streamed)


class WindowPlacer:
    """Where streamed layers go in the prefetch window of ``window`` bytes: each after the last one
    placed (or at 0 if it does not fit before the end), never over a layer still held.

    The engine's ring places its layers with it, and the planner replays a request with it
    (:func:`window_copies`), so predicted copies are the ring's own. Placement is by position in
    the streamed order; ``sizes[p]`` is layer ``p``'s device bytes.
    """

    def __init__(self, sizes: Sequence[int], window: int):
        self.sizes, self.window = tuple(int(n) for n in sizes), int(window)
        self.head = 0
        self.held: dict[int, tuple[int, int]] = {}

    def fits(self, position: int) -> int | None:
        """Where ``position`` would go now, or None while a held layer is in the way."""
        end = self.head + self.sizes[position]
        start = self.head
        if end > self.window:
            start, end = 0, self.sizes[position]
        for a, b in self.held.values():  # a loop, not any(genexpr): called at every copy, in the hooks
            if start < b and a < end:
                return None
        return start

    def take(self, position: int, start: int) -> tuple[int, int]:
        span = self.held[position] = (start, start + self.sizes[position])
        self.head = span[1]
        return span

    def free(self, position: int) -> tuple[int, int]:
        span = self.held.pop(position)
        if not self.held:
            self.head = 0  # an empty window starts again at 0: every request places alike
        elif span[1] == self.head:
            self.head = span[0]  # the last one placed (a copy dropped unrun): its bytes are next again
        return span


def window_copies(sizes: Sequence[int], window: int, uses: int, wrap: bool = True) -> int:
    """Layer copies the ring makes in one request of ``uses`` in-order uses: the prefetch before the
    first use, every layer at each use, the prefetch each layer's exit issues (wrapping into the
    next use unless ``wrap`` is False: ``StreamingConfig.wrap_uses``)."""
    n = len(sizes)
    if not n:
        return 0
    placer, copies = WindowPlacer(sizes, window), 0

    def prefetch(first: int) -> None:
        nonlocal copies
        for step in range(n):
            p = (first + step) % n
            if p == 0 and step and not wrap:
                return
            if p in placer.held:
                continue
            start = placer.fits(p)
            if start is None:
                return
            placer.take(p, start)
            copies += 1

    prefetch(0)
    for _ in range(uses):
        for p in range(n):
            if p not in placer.held:  # a cold entry: what was held is stale
                for q in list(placer.held):
                    placer.free(q)
                placer.take(p, placer.fits(p))
                copies += 1
            placer.free(p)
            if wrap or p + 1 < n:
                prefetch((p + 1) % n)
    return copies


@dataclass(frozen=True)
class RegionMap:
    """Byte regions of one device allocation, one per dtype (a slot or a resident layer)."""

    regions: tuple[tuple[torch.dtype, int, int], ...]  # (dtype, byte offset, bytes)

    @property
    def nbytes(self) -> int:
        return sum(size for _, _, size in self.regions)

    @staticmethod
    def covering(layouts: Iterable[LayerLayout], host: bool = False) -> RegionMap:
        """Regions big enough for any of ``layouts``: per dtype, the largest layer's flat bytes
        (``host``: its host buffers, as a staging buffer holds them)."""
        largest: dict[torch.dtype, int] = {}
        for layout in layouts:
            for dtype, nbytes in (layout.host_flat_bytes if host else layout.flat_bytes):
                largest[dtype] = max(largest.get(dtype, 0), nbytes)
        regions, offset = [], 0
        for dtype in sorted(largest, key=str):
            regions.append((dtype, offset, largest[dtype]))
            offset += largest[dtype]  # each size is already ALIGN_BYTES-aligned
        return RegionMap(tuple(regions))

    def carve(self, buffer: torch.Tensor) -> dict[torch.dtype, torch.Tensor]:
        """uint8 views of ``buffer``, one per dtype region."""
        assert buffer.dtype == torch.uint8 and buffer.numel() >= self.nbytes, (
            f"a {buffer.numel()} B buffer cannot hold regions of {self.nbytes} B: views would overrun it")
        return {dtype: buffer[offset:offset + size] for dtype, offset, size in self.regions}


def staging_bytes(flat_bytes: Iterable[Iterable[tuple[object, int]]], buffers: int = DEFAULT_STAGING_BUFFERS) -> int:
    """Host bytes of the staging buffers for layers with these flat layouts ((dtype, bytes) pairs).

    Each buffer is carved like a ring slot: per dtype the largest staged layer's flat bytes. There
    are ``min(buffers, layers)`` of them (more than layers would only hold a layer twice).
    """
    largest: dict[str, int] = {}
    count = 0
    for flat in flat_bytes:
        count += 1
        for dtype, nbytes in flat:
            largest[str(dtype)] = max(largest.get(str(dtype), 0), int(nbytes))
    return min(buffers, count) * sum(largest.values())


def landing_bytes(layouts: Iterable[LayerLayout]) -> int:
    """Device bytes of a streamer's landing buffers: ``LANDING_BUFFERS`` x the largest FP8 host buffer
    of its layers (aligned), 0 when none is quantized.

    Two: a layer's 8-bit bytes land in one while the previous layer's widen, on its own stream,
    still reads the other (``streaming.ring``); with one, the widen had to run on the copy stream
    between the two DMAs.
    """
    largest = max((layout.landing_bytes for layout in layouts), default=0)
    return LANDING_BUFFERS * align_up(largest) if largest else 0
