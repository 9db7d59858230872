"""The device the engine streams onto: its copy stream, its events and its headroom.

One :class:`Device` exists per ``torch.device``, created lazily on first use (``get_device``).
The same engine code runs on CUDA and on CPU: on CUDA copies run on a side stream and are
ordered with events; on CPU every copy is synchronous, so the event methods are no-ops and the
stream context is empty. Capacity on CPU is a configured fact (:class:`DeviceFacts`), so
headroom gates can be tested on machines without a GPU.
"""
from __future__ import annotations

import contextlib
import logging
import threading
import weakref
from dataclasses import dataclass
from typing import Iterator, Protocol

import psutil
import torch

from offload_core.host.pinned import HostBuffer, allocate_host_buffer, free_host_buffer
from offload_core.streaming.copier import HostCopier, InlineCopier, ThreadCopier

logger = logging.getLogger(__name__)


class WeightMeter(Protocol):
    """What headroom needs of a meter (``offload_core.streaming.meter``), without importing it."""

    @property
    def current_bytes(self) -> int: ...


@dataclass(frozen=True)
class DeviceFacts:
    """What cannot be asked of a CPU "device": how many bytes it may hold."""

    # None on CPU means "host RAM available now" (psutil); on CUDA the driver is asked instead.
    capacity_bytes: int | None = None

    def __post_init__(self) -> None:
        if self.capacity_bytes is not None and self.capacity_bytes < 0:
            raise ValueError(f"DeviceFacts.capacity_bytes must be >= 0, got {self.capacity_bytes}")


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

    def __init__(self, device: torch.device, facts: DeviceFacts):
        self.device = device
        self.is_cuda = device.type == "cuda"
        self._facts = facts
        self._copy_stream = None
        # Every stream the engine's compute ran on (CUDA): buffers are retired on each of them.
        self._compute_streams: set = set()
        self._meters: weakref.WeakSet[WeightMeter] = weakref.WeakSet()

    @property
    def facts(self) -> DeviceFacts:
        return self._facts

    def configure(self, facts: DeviceFacts) -> None:
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
        return self._copy_stream

    @contextlib.contextmanager
    def on_copy_stream(self) -> Iterator[None]:
        """Run the enclosed copies on the copy stream (CUDA); synchronously on CPU."""
        if not self.is_cuda:
            yield
            return
        with torch.cuda.stream(self.copy_stream):
            yield

    def record_copy(self):
        """An event marking the copies issued so far on the copy stream; None on CPU."""
        if not self.is_cuda:
            return None
        event = torch.cuda.Event()
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
        stream = torch.cuda.current_stream(self.device)
        self._compute_streams.add(stream)
        return stream

    def retire(self, buffers) -> None:
        """Before dropping device ``buffers``: keep them from reuse until every stream that used them is done.

        The caching allocator ties a block to the stream it was allocated on; freed while kernels
        on another current stream (or a copy) still read it, it would be handed out at once.
        ``record_stream`` on the copy stream and on every compute stream seen makes the allocator
        wait for the work queued there at the time of the free.
        """
        if not self.is_cuda:
            return
        streams = {self.copy_stream, *self._compute_streams}
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

    def host_waits(self, event) -> None:
        """Block the calling host thread until ``event`` completed (a staging buffer's last copy out)."""
        if event is not None:
            event.synchronize()

    def synchronize(self) -> None:
        if self.is_cuda:
            torch.cuda.synchronize(self.device)

    # -- staging ----------------------------------------------------------------------------------
    def host_copier(self, name: str) -> HostCopier:
        """A host thread for staging copies (CUDA); on CPU jobs run at once, copies being synchronous."""
        return ThreadCopier(name) if self.is_cuda else InlineCopier()

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

    def headroom_bytes(self) -> int:
        """Bytes a new allocation may still take on this device.

        CUDA: driver free + what torch's allocator reserved but does not use (that memory is
        free to torch, invisible to the driver). CPU: the configured capacity (or host RAM
        available) minus the weight bytes the tracked meters see materialized.
        """
        if self.is_cuda:
            free, _total = torch.cuda.mem_get_info(self.device)
            cached = torch.cuda.memory_reserved(self.device) - torch.cuda.memory_allocated(self.device)
            return int(free + cached)
        capacity = self._facts.capacity_bytes
        if capacity is None:
            return int(psutil.virtual_memory().available)
        in_use = sum(meter.current_bytes for meter in list(self._meters))
        return int(capacity - in_use)


_devices: dict[torch.device, Device] = {}
_devices_lock = threading.Lock()


def get_device(device: torch.device | str, facts: DeviceFacts | None = None) -> Device:
    """The one :class:`Device` for ``device``, created on first call; ``facts`` reconfigures it."""
    key = normalize_device(device)
    with _devices_lock:
        context = _devices.get(key)
        if context is None:
            context = Device(key, facts or DeviceFacts())
            _devices[key] = context
            return context
    if facts is not None and facts != context.facts:
        context.configure(facts)
    return context
