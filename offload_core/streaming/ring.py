"""The prefetch ring: one device allocation streamed layers take turns in, sized in bytes.

The window is ``depth + 1`` times the largest streamed layer's bytes (per dtype, as a slot was),
one device allocation. Each copy puts its layer's own bytes contiguous after the previous one's
(``buffers.WindowPlacer``: wrapping to the start when the rest does not fit, never over a layer
still held), so small layers pack: with FLUX's double then single blocks, depth 1 holds two
double blocks or four single ones, where equal slots held two of either. Parameter views are made
once per (layer, place). Entering streamed layer ``k`` waits for its copy (issuing it on a cold start); leaving it,
after its kernels were launched, releases its bytes and issues the copies of the layers after it,
in order, as far as their places are free (wrapping, so the last layer prefetches the next step's
first). The launch thread so never waits for a fill before launching a layer whose weights are
there. Nothing is allocated per prefetch, so the device holds exactly the window's bytes of
streamed weights, plus, when layers are hosted as FP8, two landing buffers their 8-bit bytes
arrive in, in turn, before they are widened into place on the device's widen stream
(``buffers.landing_bytes``): the copy stream then carries only DMAs, and a layer's widen overlaps
the next layer's DMA. The DMA into a landing buffer waits for the widen that last read it; compute
waits for its layer's widen (which waited for the DMA); a layer released before it ran makes the
copy stream wait for its widen, so no later copy overwrites bytes a widen still writes.

Faults: a copy that raises frees its place at once and reaches the caller as
:class:`~offload_core.streaming.copier.CopyFailed`; a prefetch that fails is logged and left to
the layer's own entry, which copies it again (and raises if it fails again).
"""
from __future__ import annotations

import logging
from typing import Mapping, NamedTuple, Protocol, Sequence

import torch

from offload_core.buffers import LANDING_BUFFERS, RegionMap, WindowPlacer, slot_count, window_copies
from offload_core.fp8_widen import BoundWiden, WidenMode
from offload_core.layout import FP8_HOST_DTYPE, LayerLayout
from offload_core.streaming.copier import CopyFailed, FillTimeout
from offload_core.streaming.copy_log import CopyLog
from offload_core.streaming.device import Device
from offload_core.streaming.host_layer import HostLayer
from offload_core.streaming.staging import StagingRing, cut_ranges

logger = logging.getLogger(__name__)


class RingLayer(Protocol):
    """What the ring needs of a streamed layer (``engine.RingLayer``), without importing the engine."""

    host: HostLayer

    @property
    def layout(self) -> LayerLayout: ...

    def views(self, regions: Mapping[torch.dtype, torch.Tensor]) -> tuple[torch.Tensor, ...]: ...

    def bind(self, views: tuple[torch.Tensor, ...], storage: tuple[int, int] | None = None) -> None: ...

    def release(self, keep_views: bool = False) -> None: ...

    def drop_views(self) -> None: ...


class _Place(NamedTuple):
    """A layer's copy at one byte offset of the window, made once: what each issue there needs."""

    carved: dict[torch.dtype, torch.Tensor]  # the copy's target regions
    views: tuple[torch.Tensor, ...]  # its parameters' views
    end: int  # its bytes are [start, end)
    pairs: tuple | None  # the host->device (dst, src) copies into ``carved`` (None: staged, filled per copy)
    widen: BoundWiden | None  # the FP8 widen into ``carved``, its views made once (None: not quantized)


class PrefetchRing:
    """The window and the in-flight copies for the streamed (non-resident) layers of one model."""

    def __init__(self, device: Device, layers: Sequence[RingLayer], depth: int,
                 staging: StagingRing | None = None, neighbour_wait_s: float = 30.0, landing_bytes: int = 0,
                 wrap: bool = True):
        self._device = device
        self._neighbour_wait_s = neighbour_wait_s
        self._staging = staging  # PAGEABLE and MAPPED layers copy through it
        self._layers = tuple(layers)
        # The window in largest layers (more than the layers would only hold a layer twice).
        self.n_slots = slot_count(depth, len(self._layers))
        self.regions = RegionMap.covering(layer.layout for layer in self._layers)
        self.window_bytes = self.n_slots * self.regions.nbytes
        self._own = [RegionMap.covering([layer.layout]) for layer in self._layers]
        self._placer = WindowPlacer([own.nbytes for own in self._own], self.window_bytes)
        # Where each exit's prefetch goes on: the next layer, the last one wrapping to the first (the
        # next use's) unless the uses do not wrap (-1: stop; StreamingConfig.wrap_uses).
        self._wrap = wrap
        self._next = tuple(-1 if position + 1 == len(self._layers) and not wrap else (position + 1) % len(self._layers)
                           for position in range(len(self._layers)))
        # Bytes layers were released from: (start, end, the compute event after their last reader).
        self._out: list[tuple[int, int, object]] = []
        # Sized by the engine over resident and streamed layers alike: resident FP8 layers land here too.
        self.landing_bytes = int(landing_bytes)
        self.landing: torch.Tensor | None = None
        self._landings: tuple[torch.Tensor, ...] = ()  # its LANDING_BUFFERS halves, taken in turn
        self._landing_next = 0
        self._landing_reads: list[object | None] = [None] * LANDING_BUFFERS  # each one's last widen
        self.widen_mode = WidenMode.EAGER  # the streamer's (set_widen); each place binds its widen in it
        self._buffer: torch.Tensor | None = None
        self._window_key: tuple[int, int] | None = None
        self._allocated = False
        self._in_flight: dict[int, object | None] = {}  # position -> its copy's event (None once waited)
        # Regions and parameter views per (layer, place), made once: a view costs ~2.5 us per
        # parameter (slice, dtype view, as_strided), paid at every entry otherwise. A layer takes
        # a few places at most (equal layers: depth + 1), so the cache stays small.
        self._places: dict[tuple[int, int, int], _Place] = {}  # (layer, start, landing buffer)
        self.bytes_copied = 0
        self.skipped_restarts = 0  # uses cut short by restart() (a step cache skipped their rest)
        self.wasted_copies = 0  # layers copied for a use that then skipped them
        self.out_of_order_entries = 0  # entries that found their layer not prefetched (after a cold start)
        self.failed_prefetches = 0
        self.copy_log: CopyLog | None = None  # a warm-up's record of each copy (LayerStreamer.trace_copies)

    @property
    def slot_bytes(self) -> int:
        """Device bytes of the window (the 'slots' term of the peak formula)."""
        return self.window_bytes

    @property
    def allocated(self) -> bool:
        return self._allocated

    def copies_per_request(self, uses: int) -> int:
        """Layer copies one request of ``uses`` in-order uses makes (the planner's own replay)."""
        return window_copies(self._placer.sizes, self.window_bytes, uses, self._wrap)

    def explain(self) -> str:
        """The window, for the plan and the log: its bytes and how many layers it holds ahead."""
        sizes = self._placer.sizes
        return (f"prefetch window {self.window_bytes} B ({self.n_slots} x the largest streamed layer, "
                f"{self.regions.nbytes} B): {self.window_bytes // max(sizes, default=1)}-"
                f"{self.window_bytes // max(1, min(sizes, default=1))} layers of {min(sizes, default=0)}-"
                f"{max(sizes, default=0)} B, the next issued as each layer's kernels are launched")

    def materialized(self) -> tuple[int, ...]:
        """Positions (in streamed order) whose weights occupy the window now."""
        return tuple(sorted(self._in_flight))

    def allocate(self) -> None:
        """Allocate the window once per use; the copy stream then waits for the allocating stream.

        Bytes a neighbour process leased but has not allocated yet are not taken: while only they
        keep the window from fitting, the first prefetch waits for them (bounded, HeadroomTimeout).
        """
        if self._allocated or not (self.n_slots or self.landing_bytes):
            return
        if self.n_slots:
            self._device.wait_for_neighbours(self.window_bytes, 1, self._neighbour_wait_s, "prefetch window")
        if self._buffer is not None or self.landing is not None:
            # The storages were emptied at deallocate: their memory comes back here, and the views
            # made into them stay valid (they follow the storage), so no view is rebuilt.
            for owned in self._owned():
                owned.untyped_storage().resize_(owned.numel())
        else:
            self._buffer = torch.empty(self.window_bytes, dtype=torch.uint8, device=self._device.device)
            # The meter counts the window once, keyed by its tensor (stable: its storage is emptied
            # and refilled, never replaced), whichever layer's views are bound into it.
            self._window_key = (id(self._buffer), self.window_bytes)
            if self.landing_bytes:
                self.landing = torch.empty(self.landing_bytes, dtype=torch.uint8, device=self._device.device)
                half = self.landing_bytes // LANDING_BUFFERS
                self._landings = tuple(self.landing[i * half:(i + 1) * half] for i in range(LANDING_BUFFERS))
        self._allocated = True
        self._out = []
        self._device.copy_waits_for_compute()
        logger.debug("ring on %s: allocated %s; landing %d B", self._device.device, self.explain(),
                     self.landing_bytes)

    def _owned(self) -> list[torch.Tensor]:
        return [t for t in (self._buffer, self.landing) if t is not None]

    def deallocate(self) -> None:
        """Release every layer and drop the window (stage teardown)."""
        self.release_all()
        self._device.compute_waits_for_copies()
        owned = self._owned()
        self._device.retire(owned)  # before the storages go: every stream that read them
        # Emptying the storages gives the memory back to the allocator exactly as dropping the
        # tensors would, but keeps the parameter views: rebuilding them cost ~2.5 us per parameter
        # at every request (67 us per Wan block of 27 parameters), inside the hooks.
        for buffer in owned:
            buffer.untyped_storage().resize_(0)
        self._allocated = False
        self._out = []

    def prefetch(self, position: int) -> None:
        """Issue copies for ``position`` and the layers after it, in order, while their places are free.

        A copy that fails here is not this layer's: logged, and the layer copied again when it
        is entered. A fill timeout is raised (the copier was stuck: waiting more would not help).
        """
        if not self._allocated:
            self.allocate()
        in_flight, fits, ahead, staging = self._in_flight, self._placer.fits, position, self._staging
        for _ in self._next:  # at most every layer once
            if ahead not in in_flight:
                start = fits(ahead)
                if start is None:
                    return  # a held layer is in the way: the next exit frees it
                if len(in_flight) > 1 and staging is not None and not staging.ready(self._layers[ahead]):
                    # Two layers or more are banked ahead and this one's fill is not done: waiting for
                    # it here would keep the launch thread from launching the banked layers (the GPU
                    # idles once it runs out), for a copy not needed yet; a later exit issues it, or
                    # its own entry, which waits. With one banked layer the wait is kept: skipping it
                    # delays the copy out of staging the next fill waits for (sim: 1.006 -> 1.45).
                    # Simulated FLUX-like stack, staged, depth 6: 1.120 -> 1.066 (bench/sim_overlap.py).
                    return
                try:
                    self._issue(ahead, start)
                except FillTimeout:
                    raise
                except CopyFailed as error:
                    self.failed_prefetches += 1
                    logger.warning("ring: prefetch of streamed layer %d failed (%s); copied again when entered",
                                   ahead, error)
                    return
            ahead = self._next[ahead]
            if ahead < 0:
                return  # the use's last layer: the next use is another request's

    def enter(self, position: int) -> None:
        """Before streamed layer ``position`` runs: have it on the device and make the compute wait for it."""
        if not self._allocated:
            self.allocate()
        in_flight = self._in_flight
        if position not in in_flight or not self._held_from(position):
            self._enter_out_of_order(position)
        event = in_flight[position]
        if event is not None:
            self._device.compute_waits(event)
            in_flight[position] = None

    def _held_from(self, position: int) -> bool:
        """Whether the layers held are ``position`` and the ones right after it (none held stale):
        k distinct layers all less than k after it are exactly those k."""
        n, k = len(self._layers), len(self._in_flight)
        for held in self._in_flight:
            if (held - position) % n >= k:
                return False
        return True

    def _enter_out_of_order(self, position: int) -> None:
        """An entry the ring did not prefetch for (a cold start, layers run out of order): release
        the stale copies, copy this layer now."""
        run, n = {position}, len(self._layers)
        while position in self._in_flight and len(run) < n and (position + len(run)) % n in self._in_flight:
            run.add((position + len(run)) % n)
        stale = [held for held in self._in_flight if held not in run]
        if stale or position not in self._in_flight:
            if self._in_flight:
                # Layers ran out of the order they were declared in: still correct, but the stale
                # copies were wasted. Said once at INFO, then counted (a model that always runs
                # out of order would otherwise log a line per layer).
                self.out_of_order_entries += 1
                log = logger.info if self.out_of_order_entries == 1 else logger.debug
                log("ring: layer %d entered while %s were prefetched; releasing %s (occurrence %d)",
                    position, self.materialized(), sorted(stale), self.out_of_order_entries)
            for held in stale:
                self._release(held)
        if position not in self._in_flight:
            self._issue(position)  # a cold start: the layers after it follow at its exit

    def restart(self) -> int:
        """The running use enters no more layers (a step cache skips them): the window moves to the
        next use's first layers now. In-flight copies of layers that will not run are released (their
        bytes were moved for nothing: at most ``n_slots - 1`` layers, those already prefetched) and the
        freed bytes fetch the next use's first layers. Returns how many copies were wasted."""
        if not self._layers:
            return 0
        # The next use's first window (what prefetch(0) holds from an empty window): held layers
        # in it are kept, the others were copied for nothing; released newest first, so the bytes
        # they took are the next ones placed.
        first = window_copies(self._placer.sizes, self.window_bytes, 0)
        wasted = [held for held in self._in_flight if held >= first]
        for held in reversed(wasted):
            self._release(held)
        self.skipped_restarts += 1
        self.wasted_copies += len(wasted)
        self.prefetch(0)
        return len(wasted)

    def exit(self, position: int, prefetch: bool = True) -> None:
        """After streamed layer ``position``'s kernels were launched: free its place, prefetch the next
        (not when the rest of the use is skipped: ``restart`` fetches the next use's layers instead)."""
        if position in self._in_flight:
            # Its views stay on its parameters (release_all points them back when the use ends):
            # bound again at this place, the layer finds them there (streaming.unit).
            self._release(position, keep_views=True)
        if prefetch and self._allocated and self._next[position] >= 0:
            self.prefetch(self._next[position])

    def release_all(self) -> None:
        """The use ended: every layer released, and every parameter pointed back at its placeholder
        (layers released at their exit kept their views into the window until now)."""
        for position in list(self._in_flight):
            self._release(position)
        for layer in self._layers:
            layer.drop_views()

    def _issue(self, position: int, start: int | None = None) -> None:
        """Copy streamed layer ``position`` into the window at ``start`` (where it fits now) and bind it."""
        layer = self._layers[position]
        if start is None:
            start = self._placer.fits(position)
            assert start is not None, f"streamed layer {position} issued over a held one"
        widened = self.landing is not None and bool(layer.layout.quantized)
        landing = self._landing_next if widened else 0
        place = self._places.get((position, start, landing))
        if place is None:
            place = self._place(position, start, landing)
        end = place.end
        try:
            if self._out:
                # Layers released from these bytes may still be read by queued kernels: copy only
                # after them (the compute stream runs in order, so the last one's event covers the others).
                last = None
                for a, b, event in self._out:
                    if a < end and start < b:
                        last = event
                if last is not None:
                    self._device.copy_waits(last)
            if widened:
                self._device.copy_waits(self._landing_reads[landing])  # its last widen read it
            with self._device.on_copy_stream():
                if self.copy_log is not None:
                    self.copy_log.begin()
                if self._staging is not None and self._staging.stages(layer):
                    self.bytes_copied += self._staging.copy_to(layer, place.carved)
                else:
                    self.bytes_copied += layer.host.copy_host_bytes(place.carved, pairs=place.pairs)
                event = self._device.record_copy()
                if self.copy_log is not None:
                    self.copy_log.end(getattr(layer, "key", str(position)))
            if widened:
                event = self._widen(layer, place, event, landing)
        except BaseException as error:
            # A copy issued in part is ordered before the place's next copy (same stream), and its
            # last readers are unchanged: nothing is held. An AssertionError (the simulator's
            # hazard) is an engine bug, not a copy fault: never wrapped.
            if isinstance(error, (CopyFailed, AssertionError)) or not isinstance(error, Exception):
                raise
            raise CopyFailed(f"copying streamed layer {getattr(layer, 'key', position)} to {self._device.device} "
                             f"failed: {type(error).__name__}: {error}") from error
        self._placer.take(position, start)
        if self._out:
            self._out = cut_ranges(self._out, start, end)
        layer.bind(place.views, self._window_key)
        self._in_flight[position] = event

    def _widen(self, layer: RingLayer, place: _Place, landed, landing: int):
        """Widen ``layer`` out of landing buffer ``landing`` on the widen stream, after its copy
        ``landed``; the next copy takes the other buffer. Returns the widen's event (compute waits for it)."""
        with self._device.on_widen_stream():
            self._device.widen_waits(landed)
            layer.host.widen(place.carved, place.widen)
            event = self._device.record_widen()
        self._landing_reads[landing] = event
        self._landing_next = (landing + 1) % LANDING_BUFFERS
        return event

    def _place(self, position: int, start: int, landing: int = 0) -> _Place:
        """Make (once) the regions and parameter views of layer ``position`` at byte ``start``, landing
        its FP8 bytes (if any) in landing buffer ``landing``."""
        own = self._own[position]
        carved = own.carve(self._buffer[start:start + own.nbytes])
        if self._landings:
            carved[FP8_HOST_DTYPE] = self._landings[landing]
        layer = self._layers[position]
        # The copy's targets too, sliced once per place as the views are (they follow the window's
        # storage across deallocate/allocate alike); a staged layer is filled through staging instead.
        staged = self._staging is not None and self._staging.stages(layer)
        pairs = None if staged else tuple(layer.host.fill_pairs(carved))
        # The parameters view the slot, never a landing buffer: one views object per (layer, start),
        # so an FP8 layer landing in the other buffer finds its parameters already pointed (unit.bind).
        twins = [self._places.get((position, start, other)) for other in range(len(self._landings))]
        views = next((twin.views for twin in twins if twin is not None), None) or layer.views(carved)
        place = self._places[(position, start, landing)] = _Place(carved, views, start + own.nbytes,
                                                                 pairs, layer.host.bind_widen(carved, self.widen_mode))
        return place

    def set_widen(self, mode: WidenMode) -> None:
        """Widen FP8 layers in ``mode`` from the next copy on: places bound in another mode are made again."""
        if mode is not self.widen_mode:
            self.widen_mode = mode
            self._places.clear()

    def _release(self, position: int, keep_views: bool = False) -> None:
        unwaited = self._in_flight.pop(position)
        if unwaited is not None and self.landing is not None and self._layers[position].layout.quantized:
            # Released before it ran (a restart, an out-of-order entry): no compute waited for its
            # widen, so the compute event below does not cover it; the next copy into these bytes must.
            self._device.copy_waits(unwaited)
        self._layers[position].release(keep_views)
        start, end = self._placer.free(position)
        event = self._device.record_compute()
        if event is not None:  # None: the device runs in order (CPU), no reader to wait for
            self._out.append((start, end, event))
