"""The layer streamer: per-layer hooks that bring each layer's weights to the device just in time.

``apply_layer_streaming(model, device, config)`` moves every layer of the model's layer groups to
the host (one flat buffer per dtype, or left mapped), moves the rest of the model to the device
with ONE ``model.to``, and hooks each layer: the pre-hook waits for the layer's copy and prefetches
the next ``prefetch_depth`` layers into a fixed ring of device slots; the post-hook releases the
layer to its zero-element placeholder. Resident layers are copied once, lazily, at the first
forward (or ``prepare_for_use``) and released only by ``finish_use``.

Peak device weight bytes = non-layer + resident + slots (+ one landing buffer when layers are hosted
as FP8, ``StreamingConfig.weights``), exactly (see ``predicted_peak_bytes``).

Faults: a failed copy gives back its slot and staging buffer and reaches the caller as
``CopyFailed`` (``FillTimeout`` past ``fill_timeout_s``); ``finish_use`` completes every release
whatever was raised before it (a ``BaseException`` mid-layer included, which torch's always-call
post-hook does not see), so the next use has the whole ring.
"""
from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Mapping

import torch
from torch import nn

from offload_core.host.tier import STAGED_TIERS, HostingTier
from offload_core.layout import (
    FP8_HOST_DTYPE,
    STREAMER_ATTRIBUTE,
    LayerLayout,
    LayoutError,
    RegionMap,
    check_disjoint,
    declared_layer_groups,
    landing_bytes,
    layer_parameters,
    placeholder,
    plan_layer_layout,
    unique_storage_bytes,
)
from offload_core.order import OrderedLayer, execution_order
from offload_core.progress import ByteProgress
from offload_core.quant import WeightFormat, quantized_names
from offload_core.sharded import move_unsharded
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
from offload_core.streaming.ring import PrefetchRing
from offload_core.streaming.staging import StagingRing
from offload_core.streaming.unit import StreamedLayer

logger = logging.getLogger(__name__)


class AlreadyStreamedError(RuntimeError):
    """The model already has layer streaming applied (call ``remove()`` first)."""


class ConcurrentForwardError(RuntimeError):
    """A second thread entered a streamed layer while another thread's layer was running.

    The ring holds one model's layers at a time: a second forward would release the running
    layer's weights under it (on CUDA, overwrite its slot while kernels still read it).
    """


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
        self._resident_buffers: dict[str, torch.Tensor] = {}
        # Per resident layer, the event of its own copy: its first entry per use waits for it alone.
        self._resident_events: dict[str, object] = {}
        self._resident_copied = 0
        self._armed = False
        self._landing_metered = False  # the landing buffer's bytes are in the meter (armed, or arming)
        self._skipping = False  # skip_rest_of_use: layers after the current one are not run this use
        self._restart_pending = False  # the ring restarts when the running layer is released
        self._handles: list = []
        self._running: tuple[int, StreamedLayer] | None = None  # (thread id, layer) inside a forward
        self._running_lock = threading.Lock()
        self.copy_log: CopyLog | None = None  # see trace_copies

    def _start(self, layers: tuple[StreamedLayer, ...]) -> None:
        self.layers = layers
        streamed = [layer for layer in layers if not layer.resident]
        for position, layer in enumerate(streamed):
            layer.position = position
        staged = [layer for layer in layers if layer.tier in STAGED_TIERS]
        if staged and self.config.staged_copies:
            self.staging = StagingRing(self.device, staged, [layer for layer in streamed if layer.tier in STAGED_TIERS],
                                       self.config.staging_buffers, self.config.fill_timeout_s)
        self.ring = PrefetchRing(self.device, streamed, self.config.prefetch_depth, self.staging,
                                 self.config.neighbour_wait_s, landing_bytes(layer.layout for layer in layers))
        for layer in layers:  # the layer's own methods are the hooks: one call each, no lambda between
            self._handles.append(layer.module.register_forward_pre_hook(layer.pre_forward))
            self._handles.append(layer.module.register_forward_hook(layer.post_forward, always_call=True))
        # Every layer is on its placeholder and the rest on the device: one walk counts the
        # non-layer bytes; from here on bind/release keep the count (no walk at any hook).
        self.meter.rebase()

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
        return sum(layer.nbytes for layer in self.layers if layer.resident)

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
        return self.ring.bytes_copied + self._resident_copied

    def reset_counters(self) -> None:
        self.ring.bytes_copied = 0
        self._resident_copied = 0

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
        with self._running_lock:
            self._running = None
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
        for layer in self.layers:
            if layer.resident:
                layer.release()
        self.device.compute_waits_for_copies()
        self.device.retire(self._resident_buffers.values())
        self._resident_buffers = {}
        self._resident_events = {}
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
        with self._running_lock:
            running = self._running is not None and self._running[0] == threading.get_ident()
        if running:
            self._restart_pending = True
        else:
            self.ring.restart()

    def before_layer(self, layer: StreamedLayer) -> None:
        if self._skipping:
            if layer is not self.layers[0]:
                return  # a skipped layer: its module's forward does not read its weights
            self._skipping = False
        self._claim(layer)
        if not self._armed:
            self._arm()
        if layer.resident:
            event = self._resident_events.pop(layer.key, None)
            if event is not None:  # its first entry this use waits for its own copy, not the others'
                self.device.compute_waits(event)
        else:
            self.ring.enter(layer.position)

    def after_layer(self, layer: StreamedLayer) -> None:
        # No lock: reading or replacing the one reference is atomic; the lock only makes _claim's
        # check-and-set one step. The forward hook also runs (always_call) when this thread's
        # pre-hook was refused: then the layer belongs to another thread's forward, left alone.
        running = self._running
        if running is None or running[1] is not layer or running[0] != threading.get_ident():
            return
        try:
            if not layer.resident:
                self.ring.exit(layer.position, prefetch=not self._restart_pending)
        finally:
            self._running = None
        if self._restart_pending:  # a step cache skipped the rest of this use from inside this layer
            self._restart_pending = False
            self.ring.restart()

    def _claim(self, layer: StreamedLayer) -> None:
        me = threading.get_ident()
        with self._running_lock:
            if self._running is not None and self._running[0] != me and _thread_alive(self._running[0]):
                raise ConcurrentForwardError(
                    f"{type(self.model).__name__}: layer {layer.key} entered by thread {me} while "
                    f"{self._running[1].key} runs in thread {self._running[0]}; serialize forwards "
                    "of a streamed model (one request at a time per replica)")
            self._running = (me, layer)

    def _arm(self) -> None:
        """Copy resident layers to the device and allocate the ring, once per use (lazily)."""
        if self._armed:
            return
        self.ring.allocate()
        # Not a parameter's storage, so no bind counts it: the meter is told, as for parked weights.
        self.meter.moved(self.ring.landing_bytes)
        self._landing_metered = True
        # Allocated on the compute stream (outside the copy-stream context), so the caching
        # allocator frees them in compute order at finish_use; the copies then wait for it.
        targets = []
        for layer in self.layers:
            if layer.resident:
                regions = RegionMap.covering([layer.layout])
                buffer = torch.empty(regions.nbytes, dtype=torch.uint8, device=self.device.device)
                self._resident_buffers[layer.key] = buffer
                carved = regions.carve(buffer)
                if layer.layout.quantized:
                    carved[FP8_HOST_DTYPE] = self.ring.landing
                targets.append((layer, carved))
        if self.staging is not None:
            self.staging.begin([layer for layer, _ in targets if self.staging.stages(layer)])
        try:
            self.device.copy_waits_for_compute()
            with self.device.on_copy_stream():
                for layer, carved in targets:
                    if self.copy_log is not None:
                        self.copy_log.begin()
                    if self.staging is not None and self.staging.stages(layer):
                        self._resident_copied += self.staging.copy_to(layer, carved)
                    else:
                        self._resident_copied += layer.host.copy_to(carved)
                    self._resident_events[layer.key] = self.device.record_copy()
                    if self.copy_log is not None:
                        self.copy_log.end(layer.key)
        except BaseException as error:
            if self.staging is not None:
                self.staging.stop()
            self._disarm()  # nothing was bound yet: drop the buffers, the next entry arms again
            if isinstance(error, (CopyFailed, AssertionError)) or not isinstance(error, Exception):
                raise
            raise CopyFailed(f"arming resident layers of {type(self.model).__name__} failed: "
                             f"{type(error).__name__}: {error}") from error
        for layer, carved in targets:
            layer.bind(layer.views(carved))
        self._armed = True
        logger.info("streamer %s: armed %d resident layers (%d B) and %d slots (%d B)",
                    type(self.model).__name__, len(self._resident_buffers), self.resident_bytes,
                    self.ring.n_slots, self.ring.slot_bytes)


def _thread_alive(ident: int) -> bool:
    """Whether a thread with ``ident`` still runs (a claim left by a thread that died is stale)."""
    return any(thread.ident == ident for thread in threading.enumerate())


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
    entries = _collect_layers(paths, execution_order(model, paths, trace=config.trace, layer_order=config.layer_order),
                              config.weights)
    layer_ids = {id(p) for entry in entries for p in entry.params}
    check_disjoint({e.key: e.params for e in entries}, (p for p in model.parameters() if id(p) not in layer_ids))
    tiers = _tiers(entries, config.hosting or {})

    streamer = LayerStreamer(model, context, config, non_layer_bytes=0)
    hosts = _move_layers_off(entries, tiers, context, host_layers or {})
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
                "staging %d B pinned; weights %s: %d B hosted for %d B on the device",
                type(model).__name__, context.device, len(layers), list(paths), sum(l.nbytes for l in layers),
                len(resident), config.resident_placement.value, config.prefetch_depth, streamer.ring.n_slots,
                streamer.predicted_peak_bytes(), streamer.non_layer_bytes, streamer.resident_bytes,
                streamer.ring.slot_bytes, streamer.ring.landing_bytes, counts, streamer.staging_bytes,
                config.weights.value, streamer.host_layer_bytes, sum(l.nbytes for l in layers))
    return streamer


@dataclass(frozen=True)
class _LayerEntry:
    """One layer found in a group, before it is moved: where it is and how it will be laid out."""

    group: int  # index of its group in the declared groups (moved off largest group first)
    key: str  # "single_transformer_blocks.2"
    module: nn.Module
    params: tuple[nn.Parameter, ...]  # in layout.tensors order
    layout: LayerLayout


def _collect_layers(paths: tuple[str, ...], ordered: tuple[OrderedLayer, ...],
                    weights: WeightFormat) -> tuple[_LayerEntry, ...]:
    """Every layer with parameters, in execution order (layers without any get no slot)."""
    entries = []
    for layer in ordered:
        named = layer_parameters(layer.module)
        layout = plan_layer_layout(layer.key, [(n, p.data) for n, p in named], quantized_names(layer.module, weights))
        entries.append(_LayerEntry(paths.index(layer.group), layer.key, layer.module, tuple(p for _, p in named),
                                   layout))
    return tuple(entries)


def _tiers(entries: tuple[_LayerEntry, ...], hosting: Mapping[str, HostingTier]) -> dict[str, HostingTier]:
    """Each layer's hosting tier (PAGEABLE unless named), checked before anything moves."""
    keys = [e.key for e in entries]
    unknown = sorted(set(hosting) - set(keys))
    if unknown:
        raise ValueError(f"hosting names layers that are not streamed: {unknown} (layers: {keys[:6]}...)")
    tiers = {key: hosting.get(key, HostingTier.PAGEABLE) for key in keys}
    for entry in entries:
        off_host = [name for name, p in zip((m.name for m in entry.layout.tensors), entry.params)
                    if p.device.type != "cpu"]
        if tiers[entry.key] is HostingTier.MAPPED and off_host:
            raise LayoutError(f"layer {entry.key} is planned MAPPED, which keeps host tensors as they are, "
                              f"but {off_host[0]} is on {entry.params[0].device}")
    return tiers


def _move_layers_off(entries: tuple[_LayerEntry, ...], tiers: Mapping[str, HostingTier],
                     context: Device, prebuilt: Mapping[str, HostLayer]) -> dict[str, HostLayer]:
    """Consolidate every layer on the host and release it, the largest group first.

    Largest first: when the model starts on the device, freeing the biggest group first leaves
    the most room for everything after it; each layer is released as soon as it is copied, so
    the host holds at most one layer twice. If a layer cannot be moved (a refused pin), the
    layers already moved get their weights back where they were and the error propagates.
    """
    group_bytes: dict[int, int] = {}
    for entry in entries:
        group_bytes[entry.group] = group_bytes.get(entry.group, 0) + entry.layout.nbytes
    order = sorted(entries, key=lambda e: -group_bytes[e.group])  # stable: layers keep their order
    moved: list[tuple[_LayerEntry, HostLayer, list[torch.device]]] = []
    tiers_used = sorted({tiers[e.key].value for e in entries if e.key not in prebuilt})
    try:
        # Tens of GB for a 14B model (pinning included): logged with its rate, a bar in a terminal.
        with ByteProgress(f"hosting layers ({', '.join(tiers_used) or 'shared copies'})",
                          sum(e.layout.host_nbytes for e in entries if e.key not in prebuilt)) as progress:
            for entry in order:
                host = prebuilt.get(entry.key)
                if host is not None and host.layout != entry.layout:
                    raise LayoutError(f"layer {entry.key}: the given host copy is laid out differently from the layer")
                if host is None:
                    host = HostLayer.consolidate(entry.layout, [p.data for p in entry.params], tiers[entry.key],
                                                 context.device)
                    progress.update(entry.layout.host_nbytes)
                moved.append((entry, host, [p.device for p in entry.params]))
                for param in entry.params:
                    param.data = placeholder(context.device, param.dtype)
    except Exception:
        for entry, host, devices in moved:
            for param, view, where in zip(entry.params, host.host_views(), devices):
                param.data = view.to(where)
            host.free()
        raise
    hosts = {entry.key: host for entry, host, _ in moved}
    return hosts
