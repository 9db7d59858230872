"""The resident layers of one streamed model: copied once per use, each into its own device buffer.

They are copied when the use is armed (the first forward, or ``prepare_for_use``), bound until
``finish_use`` releases them (unless kept between uses), and each one's first entry in a use waits
for its own copy only, not for the others'. Runs in the process that streams the model, on the
thread that runs its forwards.
"""
from __future__ import annotations

from typing import Sequence

import torch

from offload_core.buffers import RegionMap
from offload_core.fp8_widen import WidenMode
from offload_core.layout import FP8_HOST_DTYPE
from offload_core.streaming.copy_log import CopyLog
from offload_core.streaming.device import Device
from offload_core.streaming.staging import StagingRing
from offload_core.streaming.unit import StreamedLayer


class ResidentLayers:
    """The buffers, copy events and copied bytes of a model's resident layers."""

    def __init__(self, layers: Sequence[StreamedLayer], device: Device):
        self.layers = tuple(layer for layer in layers if layer.resident)
        self.nbytes = sum(layer.nbytes for layer in self.layers)
        self._device = device
        self._buffers: dict[str, torch.Tensor] = {}
        self._events: dict[str, object] = {}  # per layer, its own copy's event, until its first entry
        self.copied = 0  # host->device bytes since the streamer's last reset_counters
        self.widen_mode = WidenMode.EAGER  # the streamer's (set_widen)

    @property
    def armed(self) -> int:
        """Resident layers with a buffer now."""
        return len(self._buffers)

    def copy_in(self, landing: torch.Tensor | None, staging: StagingRing | None, copy_log: CopyLog | None) -> None:
        """Copy every resident layer into a buffer of its own and bind it (raises what a copy raised;
        ``release`` then drops what was allocated). FP8 layers land in ``landing`` and are widened."""
        # Allocated on the compute stream (outside the copy-stream context), so the caching
        # allocator frees them in compute order at finish_use; the copies then wait for it.
        targets = []
        for layer in self.layers:
            regions = RegionMap.covering([layer.layout])
            buffer = torch.empty(regions.nbytes, dtype=torch.uint8, device=self._device.device)
            self._buffers[layer.key] = buffer
            carved = regions.carve(buffer)
            if layer.layout.quantized:
                carved[FP8_HOST_DTYPE] = landing
            targets.append((layer, carved))
        if staging is not None:
            staging.begin([layer for layer in self.layers if staging.stages(layer)])
        self._device.copy_waits_for_compute()
        with self._device.on_copy_stream():
            for layer, carved in targets:
                if copy_log is not None:
                    copy_log.begin()
                if staging is not None and staging.stages(layer):
                    self.copied += staging.copy_to(layer, carved)
                    layer.host.widen(carved, self.widen_mode)  # a quantized layer, on the copy stream after its copy
                else:
                    self.copied += layer.host.copy_to(carved, widen=self.widen_mode)
                self._events[layer.key] = self._device.record_copy()
                if copy_log is not None:
                    copy_log.end(layer.key)
        for layer, carved in targets:
            layer.bind(layer.views(carved))

    def enter(self, layer: StreamedLayer) -> None:
        """Before resident ``layer`` runs: its first entry this use waits for its own copy."""
        event = self._events.pop(layer.key, None)
        if event is not None:
            self._device.compute_waits(event)

    def release(self) -> None:
        """Release every resident layer and give its buffer back once every stream is done with it."""
        for layer in self.layers:
            layer.release()
        self._device.compute_waits_for_copies()
        self._device.retire(self._buffers.values())
        self._buffers = {}
        self._events = {}
