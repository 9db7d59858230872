"""One layer's weights on the host, in its hosting tier, and the copy that brings them to the device.

PINNED and PAGEABLE layers are consolidated into one flat buffer per dtype, whole pages of its own
(``offload_core.host.pinned``; page-locked only on CUDA; a refused lock makes the layer PAGEABLE),
laid out as the layer's
:class:`~offload_core.layout.LayerLayout`, so a layer reaches the device in one copy per dtype.
MAPPED layers keep the original host tensors (views of the safetensors file mapping): nothing is
copied on the host, and each tensor is copied to the device on its own.

A layer laid out with quantized tensors (``LayerLayout.quantized``, ``offload_core.quant``) is
quantized once here, at consolidation, and hosted at its 8-bit size: its kept tensors' leading
run per dtype, and one FP8 buffer (values and scales). A copy lands the kept runs straight in the
slot and the FP8 buffer in one of the streamer's landing buffers (``regions[FP8_HOST_DTYPE]``);
:meth:`HostLayer.widen` then widens the quantized tensors into their slot views with a few launches
per layer (``offload_core.fp8_widen``), on whichever stream the caller orders it on: the ring's
widen stream for streamed layers (``streaming.ring``), the copy stream in ``copy_to``.
"""
from __future__ import annotations

import logging
from typing import Callable, Mapping, Sequence

import torch

from offload_core.fp8_widen import BoundWiden, WidenMode, widen_plan
from offload_core.host.pinned import HostBuffer, PinRefusal, allocate_host_buffer, free_host_buffer
from offload_core.host.tier import HostingTier
from offload_core.layout import (
    FP8_HOST_DTYPE,
    LayerLayout,
    LayoutError,
    extent_view,
    tensor_view,
)
from offload_core.quant import FP8_DTYPE, SCALE_DTYPE, dequantize_fp8, quantize_fp8
from offload_core.streaming.copier import CopyPair, copy_pairs

logger = logging.getLogger(__name__)


class HostLayer:
    """The host copy of one layer: flat buffers per dtype, or the original (mapped) tensors."""

    def __init__(self, layout: LayerLayout, tier: HostingTier,
                 buffers: Mapping[torch.dtype, HostBuffer], mapped: tuple[torch.Tensor, ...]):
        self.layout = layout
        self.tier = tier
        self._buffers = dict(buffers)
        self._mapped = mapped
        self._widen = widen_plan(layout) if layout.quantized else None  # made once: widen runs per copy

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
        if tier is HostingTier.MAPPED and layout.quantized:
            # The checkpoint's mapping holds the native weights, not their 8-bit form: quantized once
            # into anonymous memory at the 8-bit size, the layer is PAGEABLE (staged like MAPPED).
            logger.info("layer %s: planned MAPPED with FP8 weights: quantized once into %d B of anonymous "
                        "host memory (the mapping's %d B stay the checkpoint's); hosted PAGEABLE",
                        layout.key, layout.host_nbytes, layout.nbytes)
            tier = HostingTier.PAGEABLE
        if tier is HostingTier.MAPPED:
            for meta, tensor in zip(layout.tensors, params):
                if tensor.device.type != "cpu":
                    raise LayoutError(f"layer {layout.key}: MAPPED keeps host tensors as they are, "
                                      f"but {meta.name} is on {tensor.device}")
            return cls(layout, tier, {}, tuple(t.detach() for t in params))
        buffers: dict[torch.dtype, HostBuffer] = {}
        try:
            for dtype, nbytes in layout.host_flat_bytes:
                buffers[dtype] = allocate_host_buffer(nbytes, pin=tier is HostingTier.PINNED, device=device)
        except Exception:
            for buffer in buffers.values():  # a failure must not leave earlier dtypes locked
                free_host_buffer(buffer)
            raise
        refusal = next((b.refusal for b in buffers.values() if b.refusal is not None), None)
        if refusal is not None:
            tier = cls._fall_back_to_pageable(layout, buffers, refusal)
        fill_host_buffers(layout, params, {dtype: buffer.data for dtype, buffer in buffers.items()})
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
        """One host tensor per parameter, shaped and strided like the original (quantized ones widened)."""
        if self.tier is HostingTier.MAPPED:
            return self._mapped
        quantized = {at.index: at for at in self.layout.quantized}
        views = []
        for index, meta in enumerate(self.layout.tensors):
            if index in quantized:
                q, scale = _fp8_views(self._buffers[FP8_HOST_DTYPE].data, meta, quantized[index])
                views.append(dequantize_fp8(q, scale, meta.dtype))
            elif meta.extent == 0:  # nothing hosted (its dtype may have no kept run at all)
                views.append(torch.empty_strided(meta.shape, meta.stride, dtype=meta.dtype))
            else:
                views.append(tensor_view(self._buffers[meta.dtype].data, meta))
        return tuple(views)

    def copy_to(self, regions: Mapping[torch.dtype, torch.Tensor],
                pairs: Sequence[CopyPair] | None = None, widen: WidenMode = WidenMode.EAGER) -> int:
        """Copy the layer into device ``regions`` (uint8, one per dtype); returns bytes copied.

        Called inside the device's copy-stream context; ``non_blocking`` makes pinned copies
        asynchronous on CUDA, and is a plain synchronous memcpy into a separate allocation on CPU.
        A quantized layer needs ``regions[FP8_HOST_DTYPE]``, the landing buffer, and is widened.
        ``pairs``: this layer's :meth:`fill_pairs` into these same ``regions``, made once by a caller
        that copies there again and again (the ring, per place): slicing the targets at every copy
        cost ~3 us per layer on the launch thread (CPU, 14B structure), for the same views each time.
        ``widen``: how a quantized layer widens (the streamer's ``WidenMode``).
        """
        copied = self.copy_host_bytes(regions, copy_pairs, pairs)
        self.widen(regions, widen)
        return copied

    def copy_host_bytes(self, regions: Mapping[torch.dtype, torch.Tensor],
                        copy: Callable[[Sequence[CopyPair]], int] = copy_pairs,
                        pairs: Sequence[CopyPair] | None = None) -> int:
        """Copy the hosted bytes as they are (8-bit ones too) into ``regions``: a staging buffer's fill.

        ``copy`` runs the (dst, src) pairs: in order in this thread, or a copier's split over its threads.
        ``pairs``: :meth:`fill_pairs` into ``regions`` made before (see :meth:`copy_to`)."""
        return copy(pairs if pairs is not None else self.fill_pairs(regions))

    def fill_pairs(self, regions: Mapping[torch.dtype, torch.Tensor]) -> list[CopyPair]:
        """The hosted bytes as 1-D (dst, src) copies into ``regions``: one per flat buffer, or per mapped tensor."""
        if self._buffers:
            return [(regions[dtype][:buffer.nbytes], buffer.data) for dtype, buffer in self._buffers.items()]
        return [(regions[meta.dtype][meta.byte_offset:meta.byte_offset + meta.extent_bytes].view(meta.dtype),
                 extent_view(tensor))
                for meta, tensor in zip(self.layout.tensors, self._mapped) if meta.extent]

    def widen(self, regions: Mapping[torch.dtype, torch.Tensor],
              how: WidenMode | BoundWiden = WidenMode.EAGER) -> None:
        """Widen the quantized tensors from the landed FP8 buffer into ``regions`` (none: no-op): eager,
        one conversion per dtype and one multiply per group of same-shaped tensors; fused, one compiled
        pass per group (``offload_core.fp8_widen``). ``how``: a mode, or :meth:`bind_widen` of these
        same ``regions`` made before (the ring's, per place)."""
        if self._widen is None:
            return
        (how if isinstance(how, BoundWiden) else BoundWiden(self._widen, regions, how))()

    def bind_widen(self, regions: Mapping[torch.dtype, torch.Tensor], mode: WidenMode) -> BoundWiden | None:
        """The widen into ``regions`` with its views made now (None: nothing quantized)."""
        return BoundWiden(self._widen, regions, mode) if self._widen is not None else None

    def free(self) -> None:
        """Unlock page-locked buffers; the memory goes with the last view."""
        for buffer in self._buffers.values():
            free_host_buffer(buffer)
        self._buffers = {}
        self._mapped = ()


def fill_host_buffers(layout: LayerLayout, params: Sequence[torch.Tensor],
                      flats: Mapping[torch.dtype, torch.Tensor]) -> None:
    """Write ``params`` (in ``layout.tensors`` order) into the layer's host buffers ``flats`` (uint8 per
    dtype of ``layout.host_flat_bytes``): kept tensors at their offsets, quantized ones as 8-bit values
    and scales. The one writer of hosted bytes: a private layer's consolidation and a node store's file."""
    quantized = {q.index: q for q in layout.quantized}
    for index, (meta, tensor) in enumerate(zip(layout.tensors, params)):
        if index in quantized:
            q, scale = quantize_fp8(tensor.detach())
            fp8, at = flats[FP8_HOST_DTYPE], quantized[index]
            fp8[at.q_offset:at.q_offset + q.numel()].view(FP8_DTYPE).copy_(q.reshape(-1))
            fp8[at.scale_offset:at.scale_offset + at.rows * SCALE_DTYPE.itemsize].view(SCALE_DTYPE).copy_(scale)
            continue
        if meta.extent == 0:
            continue
        run = flats[meta.dtype][meta.byte_offset:meta.byte_offset + meta.extent_bytes].view(meta.dtype)
        run.copy_(extent_view(tensor.detach()))


def _fp8_views(flat: torch.Tensor, meta, at) -> tuple[torch.Tensor, torch.Tensor]:
    """The 8-bit values (shaped like the tensor) and the scales of quantized ``meta`` in uint8 ``flat``."""
    q = flat[at.q_offset:at.q_offset + meta.extent].view(FP8_DTYPE).view(meta.shape)
    scale = flat[at.scale_offset:at.scale_offset + at.rows * SCALE_DTYPE.itemsize].view(SCALE_DTYPE)
    return q, scale
