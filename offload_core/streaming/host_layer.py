"""One layer's weights on the host, in its hosting tier, and the copy that brings them to the device.

PINNED and PAGEABLE layers are consolidated into one flat buffer per dtype, whole pages of its own
(``offload_core.host.pinned``; page-locked only on CUDA; a refused lock makes the layer PAGEABLE),
laid out as the layer's
:class:`~offload_core.layout.LayerLayout`, so a layer reaches the device in one copy per dtype.
MAPPED layers keep the original host tensors (views of the safetensors file mapping): nothing is
copied on the host, and each tensor is copied to the device on its own.
"""
from __future__ import annotations

import logging
from typing import Mapping, Sequence

import torch

from offload_core.host.pinned import HostBuffer, PinRefusal, allocate_host_buffer, free_host_buffer
from offload_core.host.tier import HostingTier
from offload_core.layout import (
    LayerLayout,
    LayoutError,
    extent_view,
    tensor_view,
)

logger = logging.getLogger(__name__)


class HostLayer:
    """The host copy of one layer: flat buffers per dtype, or the original (mapped) tensors."""

    def __init__(self, layout: LayerLayout, tier: HostingTier,
                 buffers: Mapping[torch.dtype, HostBuffer], mapped: tuple[torch.Tensor, ...]):
        self.layout = layout
        self.tier = tier
        self._buffers = dict(buffers)
        self._mapped = mapped

    @classmethod
    def consolidate(cls, layout: LayerLayout, params: Sequence[torch.Tensor], tier: HostingTier,
                    device: torch.device) -> HostLayer:
        """Take ``params`` (in ``layout.tensors`` order) to the host in ``tier``."""
        assert len(params) == len(layout.tensors), (
            f"layer {layout.key}: {len(params)} tensors for {len(layout.tensors)} metadata entries; "
            "a mismatch would bind weights to the wrong parameters")
        for meta, tensor in zip(layout.tensors, params):
            if tensor.device.type == "meta":
                raise LayoutError(f"layer {layout.key}: {meta.name} is on the meta device and has no data to stream")
        if tier is HostingTier.MAPPED:
            for meta, tensor in zip(layout.tensors, params):
                if tensor.device.type != "cpu":
                    raise LayoutError(f"layer {layout.key}: MAPPED keeps host tensors as they are, "
                                      f"but {meta.name} is on {tensor.device}")
            return cls(layout, tier, {}, tuple(t.detach() for t in params))
        buffers: dict[torch.dtype, HostBuffer] = {}
        try:
            for dtype, nbytes in layout.flat_bytes:
                buffers[dtype] = allocate_host_buffer(nbytes, pin=tier is HostingTier.PINNED, device=device)
        except Exception:
            for buffer in buffers.values():  # a failure must not leave earlier dtypes locked
                free_host_buffer(buffer)
            raise
        refusal = next((b.refusal for b in buffers.values() if b.refusal is not None), None)
        if refusal is not None:
            tier = cls._fall_back_to_pageable(layout, buffers, refusal)
        for meta, tensor in zip(layout.tensors, params):
            flat = buffers[meta.dtype].data
            run = flat[meta.byte_offset:meta.byte_offset + meta.extent_bytes].view(meta.dtype)
            run.copy_(extent_view(tensor.detach()))
        return cls(layout, tier, buffers, ())

    @staticmethod
    def _fall_back_to_pageable(layout: LayerLayout, buffers: dict[torch.dtype, HostBuffer],
                               refusal: PinRefusal) -> HostingTier:
        """A refused pin makes the whole layer PAGEABLE (its other dtypes unlocked): one tier per layer."""
        for dtype, buffer in list(buffers.items()):
            if buffer.page_locked:
                free_host_buffer(buffer)
                buffers[dtype] = HostBuffer(buffer.data, buffer.nbytes, page_locked=False,
                                            mapped_bytes=buffer.mapped_bytes, refusal=refusal)
        logger.info("layer %s: planned PINNED, but %s; hosted PAGEABLE instead (%d B), copied through "
                    "the pinned staging ring where the engine has one", layout.key, refusal.explain(),
                    layout.nbytes)
        return HostingTier.PAGEABLE

    @property
    def pin_refusal(self) -> PinRefusal | None:
        """Why the layer is PAGEABLE although planned PINNED (the driver refused); None otherwise."""
        return next((b.refusal for b in self._buffers.values() if b.refusal is not None), None)

    @property
    def nbytes(self) -> int:
        """Host bytes this layer holds in its own allocations (0 for MAPPED: the mapping owns them)."""
        return sum(buffer.nbytes for buffer in self._buffers.values())

    def host_tensors(self) -> tuple[torch.Tensor, ...]:
        """The host tensors backing the layer: its flat buffers, or the original mapped views."""
        if self._buffers:
            return tuple(buffer.data for buffer in self._buffers.values())
        return self._mapped

    def host_views(self) -> tuple[torch.Tensor, ...]:
        """One host tensor per parameter, shaped and strided like the original."""
        if self.tier is HostingTier.MAPPED:
            return self._mapped
        return tuple(tensor_view(self._buffers[m.dtype].data, m) for m in self.layout.tensors)

    def copy_to(self, regions: Mapping[torch.dtype, torch.Tensor]) -> int:
        """Copy the layer into device ``regions`` (uint8, one per dtype); returns bytes copied.

        Called inside the device's copy-stream context; ``non_blocking`` makes pinned copies
        asynchronous on CUDA, and is a plain synchronous memcpy into a separate allocation on CPU.
        """
        copied = 0
        if self._buffers:
            for dtype, buffer in self._buffers.items():
                regions[dtype][:buffer.nbytes].copy_(buffer.data, non_blocking=True)
                copied += buffer.nbytes
            return copied
        for meta, tensor in zip(self.layout.tensors, self._mapped):
            if meta.extent == 0:
                continue
            run = regions[meta.dtype][meta.byte_offset:meta.byte_offset + meta.extent_bytes].view(meta.dtype)
            run.copy_(extent_view(tensor), non_blocking=True)
            copied += meta.extent_bytes
        return copied

    def free(self) -> None:
        """Unlock page-locked buffers; the memory goes with the last view."""
        for buffer in self._buffers.values():
            free_host_buffer(buffer)
        self._buffers = {}
        self._mapped = ()
