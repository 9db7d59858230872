"""The pinned staging ring: how PAGEABLE and MAPPED layers reach the device without blocking kernels.

On CUDA a copy from pageable or file-mapped memory is staged by the driver and blocks the calling
thread until it lands; issued from the thread that launches kernels, it serialises copy and
compute (the simulator measures a step at 1.5-2x max(copy, compute) that way). So such layers go
through ``n`` pinned host buffers, each carved per dtype like a ring slot and sized to the
largest staged layer:

1. a host copier thread fills the buffers in the order the engine will ask for the layers (once
   per use the staged resident layers, then the staged streamed layers cyclically), ``n`` ahead;
2. when the launch thread needs a staged layer it waits for that fill (normally long done),
   issues the asynchronous copy from pinned memory on the copy stream and records its event;
3. the buffer goes back to the copier, whose next fill into it first waits for that event: the
   copier, never the launch thread, waits for the copy to land.

Host bytes: exactly ``n x`` the region bytes (``staging_bytes``), page-locked, allocated once
and freed by ``close()`` after every copy out of them landed.
"""
from __future__ import annotations

import collections
import functools
import logging
from typing import Mapping, NamedTuple, Protocol, Sequence

import torch

from offload_core.host.pinned import HostBuffer
from offload_core.layout import DEFAULT_STAGING_BUFFERS, LayerLayout, RegionMap
from offload_core.streaming.copier import CopyJob, HostCopier
from offload_core.streaming.device import Device
from offload_core.streaming.host_layer import HostLayer

logger = logging.getLogger(__name__)



class StagedLayer(Protocol):
    host: HostLayer

    @property
    def layout(self) -> LayerLayout: ...


class _Fill(NamedTuple):
    layer: StagedLayer
    buffer: int
    job: CopyJob


class StagingRing:
    """Pinned staging buffers and the copier that fills them ahead of the launch thread."""

    def __init__(self, device: Device, staged: Sequence[StagedLayer], cycle: Sequence[StagedLayer],
                 n_buffers: int = DEFAULT_STAGING_BUFFERS):
        self._device = device
        self._staged = {id(layer) for layer in staged}
        self._cycle = tuple(cycle)  # the staged streamed layers, in streamed order
        self._cycle_index = {id(layer): i for i, layer in enumerate(self._cycle)}
        self.regions = RegionMap.covering((layer.layout for layer in staged), host=True)  # 8-bit where hosted so
        self.n_buffers = min(n_buffers, len(staged))
        self._buffers: list[HostBuffer] = []
        self._carved: list[dict[torch.dtype, torch.Tensor]] = []
        self._dma_done: list[object | None] = []
        self._free: collections.deque[int] = collections.deque()
        self._pending: collections.deque[_Fill] = collections.deque()
        self._prologue: collections.deque[StagedLayer] = collections.deque()
        self._next = 0  # index in the cycle of the next layer to fill
        self._copier: HostCopier | None = None
        self.fills = 0
        self.restarts = 0  # requests out of the fill order (cold starts, layers run out of order)

    @property
    def staging_bytes(self) -> int:
        """Page-locked host bytes of all staging buffers together (``layout.staging_bytes``, exactly)."""
        return self.n_buffers * self.regions.nbytes

    def host_tensors(self) -> tuple[torch.Tensor, ...]:
        """The staging buffers, once allocated (for the residency report)."""
        return tuple(buffer.data for buffer in self._buffers)

    def stages(self, layer: StagedLayer) -> bool:
        return id(layer) in self._staged

    def allocate(self) -> None:
        """Allocate the buffers and start the copier, once (they live until ``close``)."""
        if self._buffers or not self.n_buffers:
            return
        buffers: list[HostBuffer] = []
        try:
            for _ in range(self.n_buffers):
                buffers.append(self._device.allocate_staging(self.regions.nbytes))
        except Exception:
            for buffer in buffers:  # a refused pin must not leave the earlier buffers locked
                self._device.free_staging(buffer)
            raise
        refused = [buffer.refusal for buffer in buffers if buffer.refusal is not None]
        if refused:
            logger.info("staging on %s: %s; copies from these buffers will block like pageable ones",
                        self._device.device, refused[0].explain())
        self._buffers = buffers
        self._carved = [self.regions.carve(buffer.data) for buffer in buffers]
        self._dma_done = [None] * self.n_buffers
        self._free = collections.deque(range(self.n_buffers))
        self._copier = self._device.host_copier("offload-staging")
        logger.info("staging on %s: %d pinned buffers x %d B = %d B for %d pageable/mapped layers",
                    self._device.device, self.n_buffers, self.regions.nbytes, self.staging_bytes,
                    len(self._staged))

    def begin(self, prologue: Sequence[StagedLayer] = ()) -> None:
        """Start a use: fill ``prologue`` (staged resident layers, in arm order), then the cycle from its start."""
        if not self.n_buffers:
            return
        self.allocate()
        self._drain()
        self._prologue = collections.deque(prologue)
        self._next = 0
        self._top_up()

    def stop(self) -> None:
        """End a use: wait for the fills in flight and forget the order."""
        self._drain()
        self._prologue.clear()
        self._next = 0

    def copy_to(self, layer: StagedLayer, regions: Mapping[torch.dtype, torch.Tensor]) -> int:
        """Inside the copy-stream context: copy ``layer`` to device ``regions`` from its staging buffer."""
        if not self._pending or self._pending[0].layer is not layer:
            self._restart(layer)
        fill = self._pending.popleft()
        fill.job.result()  # the launch thread waits for the host copier only when it fell behind
        staged = self._carved[fill.buffer]
        copied = 0
        for dtype, nbytes in layer.layout.host_flat_bytes:
            regions[dtype][:nbytes].copy_(staged[dtype][:nbytes], non_blocking=True)
            copied += nbytes
        layer.host.widen(regions)  # a quantized layer: from the landing buffer into its slot, on the copy stream
        self._dma_done[fill.buffer] = self._device.record_copy()
        self._free.append(fill.buffer)
        self._top_up()
        return copied

    def close(self) -> None:
        """Wait for every fill and every copy out of the buffers, then unlock and drop them."""
        self._drain()
        for event in self._dma_done:
            self._device.host_waits(event)
        for buffer in self._buffers:
            self._device.free_staging(buffer)
        if self._copier is not None:
            self._copier.close()
        self._buffers, self._carved, self._dma_done, self._free = [], [], [], collections.deque()
        self._copier = None

    def _restart(self, layer: StagedLayer) -> None:
        """Asked out of the fill order: drop what was filled ahead and continue from ``layer``."""
        if self._pending:
            self.restarts += 1
            log = logger.info if self.restarts == 1 else logger.debug
            log("staging: %s asked while %s were filled ahead; refilling from it (occurrence %d)",
                getattr(layer, "key", "?"), [getattr(f.layer, "key", "?") for f in self._pending], self.restarts)
        self.allocate()
        self._drain()
        index = self._cycle_index.get(id(layer))
        if index is None:
            self._prologue = collections.deque([layer])
        else:
            self._prologue.clear()
            self._next = index
        self._top_up()

    def _drain(self) -> None:
        """Wait for every fill in flight; their buffers go back unread."""
        while self._pending:
            fill = self._pending.popleft()
            fill.job.result()
            self._free.append(fill.buffer)

    def _upcoming(self) -> StagedLayer | None:
        if self._prologue:
            return self._prologue.popleft()
        if not self._cycle:
            return None
        layer = self._cycle[self._next]
        self._next = (self._next + 1) % len(self._cycle)
        return layer

    def _top_up(self) -> None:
        while self._free:
            layer = self._upcoming()
            if layer is None:
                return
            buffer = self._free.popleft()
            job = functools.partial(self._fill, layer, buffer, self._dma_done[buffer])
            self._pending.append(_Fill(layer, buffer, self._copier.submit(job)))

    def _fill(self, layer: StagedLayer, buffer: int, last_copy_out) -> None:
        """On the copier: wait until the buffer's previous copy to the device landed, then fill it."""
        self._device.host_waits(last_copy_out)
        layer.host.copy_host_bytes(self._carved[buffer])
        self.fills += 1
