"""The prefetch ring: a fixed set of device slots reused by streamed layers in execution order.

``depth + 1`` slots, each one device allocation carved into one region per dtype sized to the
largest streamed layer. Entering streamed layer ``k`` waits for its copy and issues the copies of
layers ``k+1 .. k+depth`` (wrapping, so the last layer prefetches the next step's first layer);
leaving it releases its slot. Nothing is allocated per prefetch, so the device holds exactly
``slots x slot bytes`` of streamed weights at any time, plus, when layers are hosted as FP8, one
landing buffer their 8-bit bytes arrive in before they are widened into a slot
(``layout.landing_bytes``; shared by every copy, which the copy stream runs in order).

Faults: a copy that raises gives its slot back at once and reaches the caller as
:class:`~offload_core.streaming.copier.CopyFailed`; a prefetch that fails is logged and left to
the layer's own entry, which copies it again (and raises if it fails again).
"""
from __future__ import annotations

import collections
import logging
from typing import Mapping, NamedTuple, Protocol, Sequence

import torch

from offload_core.layout import FP8_HOST_DTYPE, LayerLayout, RegionMap, slot_count
from offload_core.streaming.copier import CopyFailed, FillTimeout
from offload_core.streaming.device import Device
from offload_core.streaming.host_layer import HostLayer
from offload_core.streaming.staging import StagingRing

logger = logging.getLogger(__name__)


class RingLayer(Protocol):
    """What the ring needs of a streamed layer (``engine.RingLayer``), without importing the engine."""

    host: HostLayer

    @property
    def layout(self) -> LayerLayout: ...

    def views(self, regions: Mapping[torch.dtype, torch.Tensor]) -> tuple[torch.Tensor, ...]: ...

    def bind(self, views: tuple[torch.Tensor, ...]) -> None: ...


class InFlight(NamedTuple):
    """A slot and the copy event that fills it, carried together until the compute stream waits."""

    slot: int
    event: object | None  # torch.cuda.Event; None on CPU (copies are synchronous) or once waited


class PrefetchRing:
    """Slots and in-flight copies for the streamed (non-resident) layers of one model."""

    def __init__(self, device: Device, layers: Sequence[RingLayer], depth: int,
                 staging: StagingRing | None = None, neighbour_wait_s: float = 30.0, landing_bytes: int = 0):
        self._device = device
        self._neighbour_wait_s = neighbour_wait_s
        self._staging = staging  # PAGEABLE and MAPPED layers copy through it
        self._layers = tuple(layers)
        # More slots than layers would only hold a layer twice: cap at the number of layers.
        self.n_slots = slot_count(depth, len(self._layers))
        self.regions = RegionMap.covering(layer.layout for layer in self._layers)
        # Sized by the engine over resident and streamed layers alike: resident FP8 layers land here too.
        self.landing_bytes = int(landing_bytes)
        self.landing: torch.Tensor | None = None
        self._buffers: list[torch.Tensor] = []
        self._allocated = False
        self._carved: list[dict[torch.dtype, torch.Tensor]] = []
        self._free: collections.deque[int] = collections.deque()
        self._last_use: list[object | None] = []
        self._in_flight: dict[int, InFlight] = {}
        # Parameter views per (layer position, slot), made once: building a view costs ~2.5 us per
        # parameter (slice, dtype view, as_strided), paid at every entry otherwise.
        self._views: dict[tuple[int, int], tuple[torch.Tensor, ...]] = {}
        self.bytes_copied = 0
        self.skipped_restarts = 0  # uses cut short by restart() (a step cache skipped their rest)
        self.wasted_copies = 0  # layers copied for a use that then skipped them
        self.out_of_order_entries = 0  # entries that found their layer not prefetched (after a cold start)
        self.failed_prefetches = 0

    @property
    def slot_bytes(self) -> int:
        """Device bytes of all slots together (the 'slots' term of the peak formula)."""
        return self.n_slots * self.regions.nbytes

    @property
    def allocated(self) -> bool:
        return self._allocated

    def materialized(self) -> tuple[int, ...]:
        """Positions (in streamed order) whose weights occupy a slot now."""
        return tuple(sorted(self._in_flight))

    def allocate(self) -> None:
        """Allocate the slots once per use; the copy stream then waits for the allocating stream.

        Bytes a neighbour process leased but has not allocated yet are not taken: while only they
        keep the slots from fitting, the first prefetch waits for them (bounded, HeadroomTimeout).
        """
        if self._allocated or not (self.n_slots or self.landing_bytes):
            return
        nbytes = self.regions.nbytes
        self._device.wait_for_neighbours(nbytes, self.n_slots, self._neighbour_wait_s, "prefetch ring")
        if self._buffers or self.landing is not None:
            # The slots' storages were emptied at deallocate: their memory comes back here, and
            # the views made into them stay valid (they follow the storage), so no view is rebuilt.
            for buffer in self._buffers:
                buffer.untyped_storage().resize_(nbytes)
            if self.landing is not None:
                self.landing.untyped_storage().resize_(self.landing_bytes)
        else:
            self._buffers = [torch.empty(nbytes, dtype=torch.uint8, device=self._device.device)
                             for _ in range(self.n_slots)]
            self._carved = [self.regions.carve(buffer) for buffer in self._buffers]
            if self.landing_bytes:
                self.landing = torch.empty(self.landing_bytes, dtype=torch.uint8, device=self._device.device)
                for carved in self._carved:
                    carved[FP8_HOST_DTYPE] = self.landing
        self._allocated = True
        self._free = collections.deque(range(self.n_slots))
        self._last_use = [None] * self.n_slots
        self._device.copy_waits_for_compute()
        logger.debug("ring on %s: allocated %d slots x %d B for %d streamed layers, landing %d B",
                     self._device.device, self.n_slots, nbytes, len(self._layers), self.landing_bytes)

    def deallocate(self) -> None:
        """Release every layer and drop the slots (stage teardown)."""
        self.release_all()
        self._device.compute_waits_for_copies()
        owned = [*self._buffers, *([self.landing] if self.landing is not None else [])]
        self._device.retire(owned)  # before the storages go: every stream that read them
        # Emptying the storages gives the memory back to the allocator exactly as dropping the
        # tensors would, but keeps the parameter views: rebuilding them cost ~2.5 us per parameter
        # at every request (67 us per Wan block of 27 parameters), inside the hooks.
        for buffer in owned:
            buffer.untyped_storage().resize_(0)
        self._allocated = False
        self._free, self._last_use = collections.deque(), []

    def prefetch(self, position: int) -> None:
        """Issue copies for ``position`` and the layers after it, as far as free slots allow.

        A copy that fails here is not this layer's: logged, and the layer copied again when it
        is entered. A fill timeout is raised (the copier was stuck: waiting more would not help).
        """
        self.allocate()
        for step in range(self.n_slots):
            ahead = (position + step) % len(self._layers)
            if ahead not in self._in_flight:
                if not self._free:
                    return
                try:
                    self._issue(ahead)
                except FillTimeout:
                    raise
                except CopyFailed as error:
                    self.failed_prefetches += 1
                    logger.warning("ring: prefetch of streamed layer %d failed (%s); copied again when entered",
                                   ahead, error)
                    return

    def enter(self, position: int) -> None:
        """Before streamed layer ``position`` runs: have it on the device, waited, and prefetch."""
        self.allocate()
        window = {(position + step) % len(self._layers) for step in range(self.n_slots)}
        stale = [held for held in self._in_flight if held not in window]
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
            self._issue(position)
        held = self._in_flight[position]
        self._device.compute_waits(held.event)
        self._in_flight[position] = InFlight(held.slot, None)
        self.prefetch(position)

    def restart(self) -> int:
        """The running use enters no more layers (a step cache skips them): the window moves to the
        next use's first layers now. In-flight copies of layers that will not run are released (their
        bytes were moved for nothing: at most ``n_slots - 1`` layers, those already prefetched) and the
        freed slots fetch the next use's first layers. Returns how many copies were wasted."""
        if not self._layers:
            return 0
        window = {step % len(self._layers) for step in range(self.n_slots)}
        wasted = [held for held in self._in_flight if held not in window]
        for held in wasted:
            self._release(held)
        self.skipped_restarts += 1
        self.wasted_copies += len(wasted)
        self.prefetch(0)
        return len(wasted)

    def exit(self, position: int) -> None:
        """After streamed layer ``position`` ran: give its slot back (no-op if already released)."""
        if position in self._in_flight:
            self._release(position)

    def release_all(self) -> None:
        for position in list(self._in_flight):
            self._release(position)

    @property
    def free_slots(self) -> int:
        """Slots holding no layer (all of them between uses: a slot lost to a fault would show here)."""
        return len(self._free)

    def _issue(self, position: int) -> None:
        slot = self._free.popleft()
        layer = self._layers[position]
        try:
            # The slot's previous layer may still be read by queued kernels: copy only after them.
            self._device.copy_waits(self._last_use[slot])
            with self._device.on_copy_stream():
                if self._staging is not None and self._staging.stages(layer):
                    self.bytes_copied += self._staging.copy_to(layer, self._carved[slot])
                else:
                    self.bytes_copied += layer.host.copy_to(self._carved[slot])
                event = self._device.record_copy()
        except BaseException as error:
            # A copy issued in part is ordered before the slot's next copy (same stream); the
            # slot's last reader is unchanged, so it is free again as it was.
            self._free.appendleft(slot)
            if isinstance(error, (CopyFailed, AssertionError)) or not isinstance(error, Exception):
                raise
            raise CopyFailed(f"copying streamed layer {getattr(layer, 'key', position)} to {self._device.device} "
                             f"failed: {type(error).__name__}: {error}") from error
        views = self._views.get((position, slot))
        if views is None:
            views = self._views[(position, slot)] = layer.views(self._carved[slot])
        layer.bind(views)
        self._in_flight[position] = InFlight(slot, event)

    def _release(self, position: int) -> None:
        held = self._in_flight.pop(position)
        self._layers[position].release()
        self._last_use[held.slot] = self._device.record_compute()
        self._free.append(held.slot)
