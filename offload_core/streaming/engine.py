"""The layer streamer: one model's streaming state and the per-layer hooks that drive it.

``apply_layer_streaming(model, device, config)`` moves every layer of the model's layer groups to
the host (``streaming.attach``: one flat buffer per dtype, or left mapped), moves the rest of the
model to the device with ONE ``model.to``, and hooks each layer. The hooks only delegate: the
pre-hook claims the layer for its thread (``streaming.claim``) and has its weights waited for
(``streaming.ring`` for streamed layers, ``streaming.resident`` for resident ones); the post-hook,
after the layer's kernels were launched, releases it to its placeholder and issues the next
copies. Resident layers are copied once per use, lazily, at the first forward (or
``prepare_for_use``) and released only by ``finish_use``. Runs in the process that streams the
model (a stage replica, or a user's process), on the thread that runs its forwards.

Peak device weight bytes = non-layer + resident + slots (+ two landing buffers when layers are hosted
as FP8, ``StreamingConfig.weights``), exactly (see ``predicted_peak_bytes``).

Faults: a failed copy gives back its slot and staging buffer and reaches the caller as
``CopyFailed`` (``FillTimeout`` past ``fill_timeout_s``); ``finish_use`` completes every release
whatever was raised before it (a ``BaseException`` mid-layer included, which torch's always-call
post-hook does not see), so the next use has the whole ring.
"""
from __future__ import annotations

import logging
from typing import Mapping

import torch
from torch import nn

from offload_core import fp8_widen
from offload_core.buffers import landing_bytes
from offload_core.fp8_widen import WidenMode
from offload_core.host.tier import STAGED_TIERS, HostingTier
from offload_core.layout import (
    COMPILED_ATTRIBUTE,
    STREAMER_ATTRIBUTE,
    check_disjoint,
    declared_layer_groups,
    unique_storage_bytes,
)
from offload_core.order import execution_order
from offload_core.streaming.attach import collect_layers, layer_tiers, move_layers_off
from offload_core.streaming.claim import ConcurrentForwardError, ForwardClaim  # noqa: F401 (re-exported)
from offload_core.streaming.config import (  # noqa: F401 (the engine's public names, re-exported)
    ResidentPlacement,
    StreamingConfig,
    choose_resident,
)
from offload_core.streaming.copier import CopyFailed
from offload_core.streaming.copy_log import CopyLog
from offload_core.streaming.device import Device, get_device
from offload_core.streaming.host_layer import HostLayer
from offload_core.streaming.meter import DeviceWeightMeter
from offload_core.streaming.resident import ResidentLayers
from offload_core.streaming.ring import PrefetchRing
from offload_core.streaming.staging import StagingRing
from offload_core.streaming.unit import StreamedLayer
from offload_core.tensor_parallel.sharded import move_unsharded

logger = logging.getLogger(__name__)


class AlreadyStreamedError(RuntimeError):
    """The model already has layer streaming applied (call ``remove()`` first)."""


class LayerStreamer:
    """The streaming state of one model: layers, ring, resident layers, counters, meter."""

    def __init__(self, model: nn.Module, device: Device, config: StreamingConfig, non_layer_bytes: int):
        self.model = model
        self.device = device
        self.config = config
        self.non_layer_bytes = non_layer_bytes
        self.layers: tuple[StreamedLayer, ...] = ()
        self.ring: PrefetchRing | None = None
        self.staging: StagingRing | None = None  # None: no PAGEABLE/MAPPED layer, or staging off
        self.meter = DeviceWeightMeter(model, device.device, track_headroom=True)
        self.resident: ResidentLayers = ResidentLayers((), device)
        self._armed = False
        self._landing_metered = False  # the landing buffer's bytes are in the meter (armed, or arming)
        self._skipping = False  # skip_rest_of_use: layers after the current one are not run this use
        self._restart_pending = False  # the ring restarts when the running layer is released
        self._handles: list = []
        self._claim = ForwardClaim(type(model).__name__)
        self.copy_log: CopyLog | None = None  # see trace_copies
        self.widen_mode = config.widen  # see set_widen

    def _start(self, layers: tuple[StreamedLayer, ...]) -> None:
        self.layers = layers
        self.resident = ResidentLayers(layers, self.device)
        streamed = [layer for layer in layers if not layer.resident]
        for position, layer in enumerate(streamed):
            layer.position = position
        staged = [layer for layer in layers if layer.tier in STAGED_TIERS]
        if staged and self.config.staged_copies:
            self.staging = StagingRing(self.device, staged, [layer for layer in streamed if layer.tier in STAGED_TIERS],
                                       self.config.staging_buffers, self.config.fill_timeout_s,
                                       self.config.copier_threads)
        self.ring = PrefetchRing(self.device, streamed, self.config.prefetch_depth, self.staging,
                                 self.config.neighbour_wait_s, landing_bytes(layer.layout for layer in layers),
                                 wrap=self.config.wrap_uses)
        # Streamed again under compiled blocks (a replica's re-plan): the fused widen, as compile turned on.
        self.set_widen(WidenMode.FUSED if getattr(self.model, COMPILED_ATTRIBUTE, None) is not None else self.config.widen)
        for layer in layers:  # the layer's own methods are the hooks: one call each, no lambda between
            self._handles.append(layer.module.register_forward_pre_hook(layer.pre_forward))
            self._handles.append(layer.module.register_forward_hook(layer.post_forward, always_call=True))
        # Every layer is on its placeholder and the rest on the device: one walk counts the
        # non-layer bytes; from here on bind/release keep the count (no walk at any hook).
        self.meter.rebase()

    def set_widen(self, mode: WidenMode) -> None:
        """How FP8 layers widen from now on (``fp8_widen.WidenMode``); block compile turns FUSED on.
        FUSED where it cannot compile (``fp8_widen.fused_refusal``) stays EAGER, said why."""
        mode = WidenMode(mode)
        quantized = any(layer.layout.quantized for layer in self.layers)
        refusal = fp8_widen.fused_refusal(self.device.device) if mode is WidenMode.FUSED and quantized else None
        if refusal is not None:
            logger.info("streaming %s: FP8 widen stays eager, not fused: %s", type(self.model).__name__, refusal)
            mode = WidenMode.EAGER
        if mode is not self.widen_mode and quantized:
            logger.info("streaming %s: FP8 widen %s -> %s", type(self.model).__name__, self.widen_mode.value, mode.value)
        self.widen_mode = mode
        self.ring.set_widen(mode)
        self.resident.widen_mode = mode

    def trace_copies(self, log: CopyLog | None) -> None:
        """Log every layer copy (its start and end on the copy stream) into ``log``; None stops.

        A warm-up's measured pass draws them beside its compute; a request never logs."""
        self.copy_log = log
        if self.ring is not None:
            self.ring.copy_log = log
        if self.staging is not None:
            self.staging.copy_log = log

    @property
    def resident_bytes(self) -> int:
        return self.resident.nbytes

    @property
    def staging_bytes(self) -> int:
        """Page-locked host bytes of the staging buffers (0 without PAGEABLE/MAPPED layers or staging)."""
        return self.staging.staging_bytes if self.staging is not None else 0

    def predicted_peak_bytes(self) -> int:
        """Device weight bytes at peak: non-layer + resident + slots + landing (FP8 layers only)."""
        return self.non_layer_bytes + self.resident_bytes + self.ring.slot_bytes + self.ring.landing_bytes

    @property
    def host_layer_bytes(self) -> int:
        """Host bytes of every layer's copy as hosted (8-bit ones where quantized)."""
        return sum(layer.layout.host_nbytes for layer in self.layers)

    @property
    def bytes_copied(self) -> int:
        """Host->device bytes copied since the last ``reset_counters`` (streamed and resident)."""
        return self.ring.bytes_copied + self.resident.copied

    def reset_counters(self) -> None:
        self.ring.bytes_copied = 0
        self.resident.copied = 0

    # -- lifecycle --------------------------------------------------------------------------------
    def prepare_for_use(self) -> None:
        """Arm resident layers and issue the first copies, before the first forward needs them."""
        with torch.inference_mode(False):
            self._arm()
            if self.ring.n_slots:
                self.ring.prefetch(0)

    def finish_use(self, keep_resident: bool | None = None) -> None:
        """Force-release streamed layers; resident layers and slots too unless kept.

        Runs to the end whatever a forward left behind (a layer that raised, a ``BaseException``
        that skipped the post-hook): the use is over, so no layer of it is running any more.
        """
        keep = self.config.keep_resident if keep_resident is None else keep_resident
        self._claim.clear()
        self._skipping = self._restart_pending = False  # a skip lasts to the end of its use at most
        try:
            self.ring.release_all()
            if self.staging is not None:
                self.staging.stop()
        finally:
            if not keep:
                self._disarm()
            elif self.staging is not None:
                self.staging.begin()  # fill the next use's first staged layers while the replica idles
        logger.info("streamer %s: finished use, %s resident layers (%d B) and slots",
                    type(self.model).__name__, "kept" if keep else "released", self.resident_bytes)

    def _disarm(self) -> None:
        """Release resident layers and drop their buffers and the slots (also after a failed arm)."""
        self.resident.release()
        if self._landing_metered:
            self.meter.moved(-self.ring.landing_bytes)  # the landing buffer goes with the slots
            self._landing_metered = False
        self.ring.deallocate()
        self._armed = False

    def remove(self) -> None:
        """Undo streaming: hooks removed, layers back as plain host tensors (views of their buffers).

        A second call does nothing (a replica closed, then collected, removes twice): the host
        buffers are gone by then, and the model already holds its weights.
        """
        if getattr(self.model, STREAMER_ATTRIBUTE, None) is not self:
            return
        self.finish_use(keep_resident=False)
        if self.staging is not None:
            self.staging.close()
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self.meter.close()
        for layer in self.layers:
            for param, host in zip(layer.params, layer.host.host_views()):
                param.data = host
            layer.host.free()
        delattr(self.model, STREAMER_ATTRIBUTE)
        logger.info("streamer %s: removed; layer weights are host tensors again", type(self.model).__name__)

    # -- hooks ------------------------------------------------------------------------------------
    def skip_rest_of_use(self) -> int:
        """The running forward will not run the layers after the current one (a step cache decided
        from the first layer's output): their hooks do nothing until the first layer is entered
        again (the next use), and the ring starts fetching that use's first layers now, before its
        window fills with layers that will not run. Returns the layers whose copies were already
        issued and are wasted: at most ``prefetch_depth`` (the window ahead of the current layer);
        counted in ``ring.wasted_copies``. Called from inside the current layer's forward, the ring
        restarts once that layer is released (its post-hook), so its own slot is not given away early.
        """
        self._skipping = True
        if self._claim.in_this_thread():
            self._restart_pending = True
        else:
            self.ring.restart()

    def before_layer(self, layer: StreamedLayer) -> None:
        if self._skipping:
            if layer is not self.layers[0]:
                return  # a skipped layer: its module's forward does not read its weights
            self._skipping = False
        self._claim.claim(layer)
        if not self._armed:
            self._arm()
        if layer.resident:
            self.resident.enter(layer)
        else:
            self.ring.enter(layer.position)

    def after_layer(self, layer: StreamedLayer) -> None:
        # The forward hook also runs (always_call) when this thread's pre-hook was refused: then
        # the layer belongs to another thread's forward and is left alone.
        if not self._claim.owns(layer):
            return
        try:
            if not layer.resident:
                self.ring.exit(layer.position, prefetch=not self._restart_pending)
        finally:
            self._claim.clear()
        if self._restart_pending:  # a step cache skipped the rest of this use from inside this layer
            self._restart_pending = False
            self.ring.restart()

    def _arm(self) -> None:
        """Copy resident layers to the device and allocate the ring, once per use (lazily)."""
        if self._armed:
            return
        self.ring.allocate()
        # Not a parameter's storage, so no bind counts it: the meter is told, as for parked weights.
        self.meter.moved(self.ring.landing_bytes)
        self._landing_metered = True
        try:
            self.resident.copy_in(self.ring.landing, self.staging, self.copy_log)
        except BaseException as error:
            if self.staging is not None:
                self.staging.stop()
            self._disarm()  # nothing stays bound: the buffers are dropped, the next entry arms again
            if isinstance(error, (CopyFailed, AssertionError)) or not isinstance(error, Exception):
                raise
            raise CopyFailed(f"arming resident layers of {type(self.model).__name__} failed: "
                             f"{type(error).__name__}: {error}") from error
        self._armed = True
        logger.info("streamer %s: armed %d resident layers (%d B) and %d slots (%d B)",
                    type(self.model).__name__, self.resident.armed, self.resident_bytes,
                    self.ring.n_slots, self.ring.slot_bytes)


def apply_layer_streaming(model: nn.Module, device: torch.device | str | Device,
                          config: StreamingConfig | None = None, *,
                          host_layers: Mapping[str, HostLayer] | None = None) -> LayerStreamer:
    """Stream ``model``'s layer groups onto ``device``; returns the streamer that controls it.

    ``device`` may be a :class:`Device` itself (the simulated accelerator, a test's device).
    ``host_layers``: host copies already made elsewhere (a node weight store's shared layers), by
    layer key; those layers are not consolidated, their parameters are only released.
    """
    config = config or StreamingConfig()
    if not isinstance(model, nn.Module):
        raise TypeError(f"apply_layer_streaming needs an nn.Module, got {type(model).__name__}")
    if getattr(model, STREAMER_ATTRIBUTE, None) is not None:
        raise AlreadyStreamedError(f"{type(model).__name__} is already under layer streaming; call remove() first")
    context = device if isinstance(device, Device) else get_device(device)
    paths = config.layer_groups or declared_layer_groups(model)
    entries = collect_layers(paths, execution_order(model, paths, trace=config.trace, layer_order=config.layer_order),
                              config.weights)
    layer_ids = {id(p) for entry in entries for p in entry.params}
    check_disjoint({e.key: e.params for e in entries}, (p for p in model.parameters() if id(p) not in layer_ids))
    tiers = layer_tiers(entries, config.hosting or {})

    streamer = LayerStreamer(model, context, config, non_layer_bytes=0)
    hosts = move_layers_off(entries, tiers, context, host_layers or {})
    # ONE move of the non-layer rest (DTensors stay where their mesh put them); every layer weight is a placeholder now
    move_unsharded(model, context.device)
    streamer.non_layer_bytes = unique_storage_bytes(p for p in model.parameters() if id(p) not in layer_ids)
    if isinstance(config.resident, int) and config.resident > len(entries):
        logger.info("streaming %s: resident=%d asked, only %d layers: all layers resident",
                    type(model).__name__, config.resident, len(entries))
    resident = choose_resident(len(entries), config.resident_count(len(entries)), config.resident_placement)
    layers = tuple(StreamedLayer(e.key, e.module, e.params, hosts[e.key], i in resident, context.device, streamer)
                   for i, e in enumerate(entries))
    streamer._start(layers)
    setattr(model, STREAMER_ATTRIBUTE, streamer)
    if streamer.staging is not None:
        try:
            # Now, not at the first use: the staging bytes are held from here on, as planned and
            # reported; a refused pin surfaces here, with the model given back as it came.
            streamer.staging.allocate()
        except Exception:
            streamer.remove()
            raise
    counts = {tier.value: sum(1 for l in layers if l.tier is tier) for tier in HostingTier}
    logger.info("streaming %s on %s: %d layers in %s (%d B), %d resident (%s), depth %d -> %d slots; "
                "predicted peak %d B = non-layer %d + resident %d + slots %d + landing %d; hosting %s; "
                "staging %d B pinned; weights %s (widen %s): %d B hosted for %d B on the device",
                type(model).__name__, context.device, len(layers), list(paths), sum(l.nbytes for l in layers),
                len(resident), config.resident_placement.value, config.prefetch_depth, streamer.ring.n_slots,
                streamer.predicted_peak_bytes(), streamer.non_layer_bytes, streamer.resident_bytes,
                streamer.ring.slot_bytes, streamer.ring.landing_bytes, counts, streamer.staging_bytes,
                config.weights.value, streamer.widen_mode.value, streamer.host_layer_bytes, sum(l.nbytes for l in layers))
    return streamer
