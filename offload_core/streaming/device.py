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
        event.record(torch.cuda.current_stream(self.device))
        return event

    def compute_waits(self, event) -> None:
        """Make the compute stream wait for ``event`` (a copy) without blocking the host."""
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)

    def copy_waits(self, event) -> None:
        """Make the copy stream wait for ``event`` (the last compute that read a slot)."""
        if event is not None:
            self.copy_stream.wait_event(event)

    def copy_waits_for_compute(self) -> None:
        """Order the copy stream after all compute so far (e.g. after allocating slots on it)."""
        if self.is_cuda:
            self.copy_stream.wait_stream(torch.cuda.current_stream(self.device))

    def compute_waits_for_copies(self) -> None:
        """Order the compute stream after every copy issued so far.

        Needed before dropping a slot: the caching allocator only knows the compute stream, so
        without this wait it could hand the slot's memory to a new tensor while a prefetch copy
        (the wrapped one, issued by the last layer) is still writing into it.
        """
        if self.is_cuda:
            torch.cuda.current_stream(self.device).wait_stream(self.copy_stream)

    def synchronize(self) -> None:
        if self.is_cuda:
            torch.cuda.synchronize(self.device)

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
