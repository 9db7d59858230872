"""The device the engine streams onto: its copy stream, its events and its headroom.

One :class:`Device` exists per ``torch.device``, created lazily on first use (``get_device``).
The same engine code runs on CUDA and on CPU: on CUDA copies run on a side stream and are
ordered with events; on CPU every copy is synchronous, so the event methods are no-ops and the
stream context is empty. Capacity on CPU is a configured fact (:class:`DeviceCapacity`), so
headroom gates can be tested on machines without a GPU.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Callable, Protocol

import psutil
import torch

from offload_core.host.pinned import HostBuffer, allocate_host_buffer, free_host_buffer
from offload_core.streaming import cuda_streams, fill_threads
from offload_core.streaming.copier import HostCopier, InlineCopier, ThreadCopier
from offload_core.streaming.headroom import CachedBlocks, Headroom, HeadroomTimeout, cuda_cached_blocks, usable_blocks

logger = logging.getLogger(__name__)
_NO_STREAM = contextlib.nullcontext()  # CPU copies run where they are issued (reentrant, shared)


class WeightMeter(Protocol):
    """What headroom needs of a meter (``offload_core.streaming.meter``), without importing it."""

    @property
    def current_bytes(self) -> int: ...


# How often a wait for neighbours' leases looks again: a call's lease ends within tens of ms at the
# soonest (a tiny-model stage call), so 10 ms adds little to a wait and costs one cached read.
NEIGHBOUR_POLL_S = 0.01
# Bytes other processes on this device leased and have not allocated yet (set by the replica from
# its node ledger's figures; offload_core never asks the ledger itself).
NeighbourBytes = Callable[[], int]
# The allocator's cached blocks of a device: (device, detailed) -> CachedBlocks; detailed reads
# every split free block's size.
CachedSource = Callable[[torch.device, bool], CachedBlocks]


@dataclass(frozen=True)
class DeviceCapacity:
    """What cannot be asked of a CPU "device": how many bytes it may hold."""

    # None on CPU means "host RAM available now" (psutil); on CUDA the driver is asked instead.
    capacity_bytes: int | None = None

    def __post_init__(self) -> None:
        if self.capacity_bytes is not None and self.capacity_bytes < 0:
            raise ValueError(f"DeviceCapacity.capacity_bytes must be >= 0, got {self.capacity_bytes}")


def normalize_device(device: torch.device | str) -> torch.device:
    """``"cuda"`` -> ``cuda:<current>``, so one device has one key (and one placeholder per dtype)."""
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device} asked for, but CUDA is not available on this machine")
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


class Device:
    """Copy stream, events and headroom of one device. Use :func:`get_device`, not the constructor."""

    def __init__(self, device: torch.device, facts: DeviceCapacity):
        self.device = device
        self.is_cuda = device.type == "cuda"
        self._facts = facts
        self._copy_stream = None
        self._copy_raw: cuda_streams.RawStream | None = None
        self._widen_stream = None
        self._widen_raw: cuda_streams.RawStream | None = None
        # Every stream the engine's compute ran on (CUDA): buffers are retired on each of them.
        self._compute_streams = cuda_streams.CurrentStreams(device) if self.is_cuda else None
        self._meters: weakref.WeakSet[WeightMeter] = weakref.WeakSet()
        self._neighbours: NeighbourBytes | None = None
        self._cached: CachedSource | None = None

    @property
    def facts(self) -> DeviceCapacity:
        return self._facts

    def configure(self, facts: DeviceCapacity) -> None:
        """Replace the configured facts (tests and CPU deployments set a capacity)."""
        logger.info("device %s: capacity set to %s B", self.device, facts.capacity_bytes)
        self._facts = facts

    # -- streams and events -------------------------------------------------------------------
    @property
    def copy_stream(self):
        """The side stream host->device copies run on (CUDA only; None on CPU).

        Why a side stream: copies issued on the compute stream would queue behind the running
        layer's kernels, so layer i+1's weights could only start moving once layer i finished;
        on their own stream they overlap layer i's compute, which is the whole point of prefetch.
        """
        if self.is_cuda and self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream(device=self.device)
            self._copy_raw = cuda_streams.raw(self._copy_stream)
        return self._copy_stream

    def on_copy_stream(self) -> contextlib.AbstractContextManager:
        """Run the enclosed copies on the copy stream (CUDA); synchronously on CPU.

        Not a generator context manager: it is entered once per layer copy, inside the hooks, and a
        ``contextlib.contextmanager`` costs a generator and two frames each time (~1 us on CPU);
        nor ``torch.cuda.stream``, for what it costs on CUDA (``cuda_streams``).
        """
        if not self.is_cuda:
            return _NO_STREAM
        stream = self.copy_stream
        return cuda_streams.StreamSwitch(stream, self._copy_raw)

    @property
    def widen_stream(self):
        """The side stream FP8 layers are widened on (CUDA only; None on CPU).

        Why not the copy stream: there each layer's widen (~0.32 ms of kernels per real-size
        Wan2.1-1.3B block on the H200) sits between its DMA (0.86 ms) and the next layer's, so the
        copy stream is busy 1.18 ms a layer where the link needs 0.86. On its own stream, behind
        the ring's second landing buffer, it overlaps the next layer's DMA.
        """
        if self.is_cuda and self._widen_stream is None:
            self._widen_stream = torch.cuda.Stream(device=self.device)
            self._widen_raw = cuda_streams.raw(self._widen_stream)
        return self._widen_stream

    def on_widen_stream(self) -> contextlib.AbstractContextManager:
        """Run the enclosed kernels on the widen stream (CUDA); in program order on CPU."""
        if not self.is_cuda:
            return _NO_STREAM
        stream = self.widen_stream
        return cuda_streams.StreamSwitch(stream, self._widen_raw)

    def record_widen(self):
        """An event marking the widens issued so far (a landing buffer's last reader); None on CPU."""
        if not self.is_cuda:
            return None
        event = torch.cuda.Event()
        event.record(self.widen_stream)
        return event

    def widen_waits(self, event) -> None:
        """Make the widen stream wait for ``event`` (the copy that landed the FP8 bytes)."""
        if event is not None:
            self.widen_stream.wait_event(event)

    def record_copy(self):
        """An event marking the copies issued so far on the copy stream; None on CPU."""
        if not self.is_cuda:
            return None
        # blocking=True: the copier waits for these in host_waits; a default event spins a core in
        # cudaEventSynchronize for the whole copy (a 58 MB Wan block at 25 GB/s: 2.3 ms per layer).
        event = torch.cuda.Event(blocking=True)
        event.record(self.copy_stream)
        return event

    def record_compute(self):
        """An event marking the compute stream's work so far (a slot's last reader); None on CPU."""
        if not self.is_cuda:
            return None
        event = torch.cuda.Event()
        event.record(self._compute_stream())
        return event

    def compute_waits(self, event) -> None:
        """Make the compute stream wait for ``event`` (a copy) without blocking the host."""
        if event is not None:
            self._compute_stream().wait_event(event)

    def _compute_stream(self):
        """The current stream, remembered: whatever reads a slot there must finish before it is reused."""
        return self._compute_streams.current()

    def retire(self, buffers) -> None:
        """Before dropping device ``buffers``: keep them from reuse until every stream that used them is done.

        The caching allocator ties a block to the stream it was allocated on; freed while kernels
        on another current stream (or a copy) still read it, it would be handed out at once.
        ``record_stream`` on the copy stream and on every compute stream seen makes the allocator
        wait for the work queued there at the time of the free.
        """
        if not self.is_cuda:
            return
        streams = {self.copy_stream, *self._compute_streams.seen()}
        if self._widen_stream is not None:
            streams.add(self._widen_stream)
        for buffer in buffers:
            for stream in streams:
                buffer.record_stream(stream)

    def copy_waits(self, event) -> None:
        """Make the copy stream wait for ``event`` (the last compute that read a slot)."""
        if event is not None:
            self.copy_stream.wait_event(event)

    def copy_waits_for_compute(self) -> None:
        """Order the copy stream after all compute so far (e.g. after allocating slots on it)."""
        if self.is_cuda:
            self.copy_stream.wait_stream(self._compute_stream())

    def compute_waits_for_copies(self) -> None:
        """Order the compute stream after every copy issued so far.

        Needed before dropping a slot: the caching allocator only knows the compute stream, so
        without this wait it could hand the slot's memory to a new tensor while a prefetch copy
        (the wrapped one, issued by the last layer) is still writing into it.
        """
        if self.is_cuda:
            self._compute_stream().wait_stream(self.copy_stream)
            if self._widen_stream is not None:  # widens write slots too
                self._compute_stream().wait_stream(self._widen_stream)

    def host_waits(self, event) -> None:
        """Block the calling host thread until ``event`` completed (a staging buffer's last copy out).

        The thread sleeps (``record_copy`` makes blocking events), it does not spin."""
        if event is not None:
            event.synchronize()

    def synchronize(self) -> None:
        if self.is_cuda:
            torch.cuda.synchronize(self.device)

    # -- staging ----------------------------------------------------------------------------------
    def host_copier(self, name: str, threads: int | None = None) -> HostCopier:
        """A host thread for staging copies (CUDA); on CPU jobs run at once, copies being synchronous.

        Each fill splits over ``threads``; None: on CUDA the fill probe's count under the default
        cap (``fill_threads``, measured once per process), on CPU one (compute runs on those cores)."""
        if not self.is_cuda:
            return InlineCopier(threads or 1)
        if threads is None:
            threads = fill_threads.device_probe(self.device, fill_threads.default_cap()).threads
        return ThreadCopier(name, threads)

    def allocate_staging(self, nbytes: int) -> HostBuffer:
        """A host buffer the device copies from asynchronously: page-locked on CUDA."""
        return allocate_host_buffer(nbytes, pin=True, device=self.device)

    def free_staging(self, buffer: HostBuffer) -> None:
        """Unlock a staging buffer; the caller has waited for every copy out of it."""
        free_host_buffer(buffer)

    # -- memory ---------------------------------------------------------------------------------
    def track(self, meter: WeightMeter) -> None:
        """Count ``meter``'s current bytes as used when computing CPU headroom."""
        self._meters.add(meter)

    def untrack(self, meter: WeightMeter) -> None:
        """Stop counting ``meter`` (its model left the engine): explicit, not left to the GC."""
        self._meters.discard(meter)

    def set_neighbours(self, outstanding: NeighbourBytes | None) -> None:
        """Count ``outstanding()`` bytes (leased by other processes on this device, not allocated
        yet) out of headroom. The replica sets it from its node ledger's figures; it must be cheap
        (a cached number): headroom is asked at decisions on the call path."""
        self._neighbours = outstanding

    def set_allocator(self, cached: CachedSource | None) -> None:
        """Where the allocator's cached blocks are read (tests give a fake; None: the device's own)."""
        self._cached = cached

    def headroom(self, min_block: int = 0, settled: Callable[[Headroom], bool] | None = None) -> Headroom:
        """What allocations of at least ``min_block`` bytes can still get on this device, by part.

        CUDA: driver free (less neighbours' outstanding leases) + whole free cached segments, within
        the process cap, + cached free blocks of at least ``min_block``. CPU: the configured
        capacity (or host RAM available) minus the weight bytes the tracked meters see, less
        neighbours' outstanding leases; no cache unless a fake allocator is set. The cached blocks'
        sizes (a walk of every segment) are read only when the answer depends on them and
        ``settled`` (if given) does not already say the answer without them is enough for the question.
        """
        if self.is_cuda:
            driver_free, _total = torch.cuda.mem_get_info(self.device)
        elif self._facts.capacity_bytes is None:
            driver_free = psutil.virtual_memory().available
        else:
            driver_free = self._facts.capacity_bytes - sum(meter.current_bytes for meter in list(self._meters))
        neighbours = max(0, int(self._neighbours())) if self._neighbours is not None else 0
        source = self._cached or (cuda_cached_blocks if self.is_cuda else None)
        blocks = source(self.device, False) if source is not None else CachedBlocks()
        usable = usable_blocks(blocks, min_block)
        if usable is None:
            partial = Headroom(min_block, int(driver_free), neighbours, blocks)
            if settled is not None and settled(partial):
                usable = ()
            else:
                blocks = source(self.device, True)
                usable = usable_blocks(blocks, min_block) or ()
        return Headroom(min_block, int(driver_free), neighbours, blocks, usable)

    def wait_for_neighbours(self, nbytes: int, count: int, timeout_s: float, what: str) -> Headroom | None:
        """Before ``count`` allocations of ``nbytes``: if only neighbours' outstanding leases keep
        them from fitting, wait (bounded) for those leases to end; HeadroomTimeout after ``timeout_s``.

        A shortfall that is this device's own (its capacity, the process cap) is not waited for:
        the allocation itself decides, as before. Polls every NEIGHBOUR_POLL_S: the neighbours'
        figure is a cached number, refreshed by the replica's ledger heartbeat. Returns None at once
        (nothing measured) when no neighbour holds an outstanding lease: the common case costs one read.
        """
        if count <= 0 or self._neighbours is None or self._neighbours() <= 0:
            return None

        def fit(room: Headroom) -> bool:
            return room.allocations(nbytes) >= count

        room = self.headroom(nbytes, settled=fit)
        if fit(room):
            return room
        if not fit(dataclasses.replace(room, neighbours_outstanding=0)):
            return room  # short even without the neighbours: not theirs to give back
        logger.info("%s on %s: %d x %d B wait for neighbours' leases: %s", what, self.device, count, nbytes,
                    room.explain())
        start = time.monotonic()
        while not fit(room):
            waited = time.monotonic() - start
            if waited >= timeout_s:
                raise HeadroomTimeout(what, nbytes * count, waited, room)
            time.sleep(min(NEIGHBOUR_POLL_S, timeout_s - waited))
            room = self.headroom(nbytes, settled=fit)
        logger.info("%s on %s: room after %.2f s: %s", what, self.device, time.monotonic() - start, room.explain())
        return room

    def headroom_bytes(self, min_block: int = 0) -> int:
        """Bytes allocations of at least ``min_block`` bytes may still take (:meth:`headroom`)."""
        return self.headroom(min_block).usable_bytes


_devices: dict[torch.device, Device] = {}
_devices_lock = threading.Lock()


def get_device(device: torch.device | str, facts: DeviceCapacity | None = None) -> Device:
    """The one :class:`Device` for ``device``, created on first call; ``facts`` reconfigures it."""
    key = normalize_device(device)
    with _devices_lock:
        context = _devices.get(key)
        if context is None:
            context = Device(key, facts or DeviceCapacity())
            _devices[key] = context
            return context
    if facts is not None and facts != context.facts:
        context.configure(facts)
    return context
