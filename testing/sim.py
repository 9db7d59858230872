"""A simulated accelerator: data on the CPU, computed for real, timed on a virtual clock by CUDA's rules.

CI has no GPU, and a CPU run cannot show whether copies overlap compute: on CPU every copy is
synchronous. :class:`SimDevice` is a :class:`~offload_core.streaming.device.Device` whose tensors
live on the CPU (so outputs stay bitwise checkable against the plain model) while every copy and
every kernel advances a virtual clock under the rules a real GPU imposes:

- two streams, the compute stream (the current one) and the copy stream; an operation starts when
  its stream reached it, its host thread issued it and the engine it needs is free;
- one host->device copy engine: copies serialise on it whatever stream issued them;
- a copy from PINNED memory with ``non_blocking=True`` is asynchronous: the host thread issues it
  and goes on; with ``non_blocking=False`` the host thread waits until it landed;
- a copy from PAGEABLE or MAPPED memory is staged by the driver and blocks the host thread until
  it lands (that host thread cannot launch kernels meanwhile);
- every copy pays ``copy_latency_s`` on the copy engine, every kernel launch and copy issue
  ``launch_s`` of its host thread's time;
- kernels launch asynchronously on the current stream; events mark a stream's position, a wait
  makes a stream start nothing before the event; kernels on every stream share the SMs
  (``testing.sim_sms``: a widen on the copy stream takes compute time where compute is busy);
- a layer's compute is ``kernels`` kernels (``charge_layer_compute``), each costing ``launch_s`` on
  the launch thread: where the launches outlast the kernels the step is launch-bound, and any
  host time on that thread (hooks: ``host_s``; a wait) adds to it;
- an FP8 layer's widen (``charge_widen``) launches its kernels on the copy stream from whichever
  thread issues the copy, and may synchronise that thread with the copy stream (the per-tensor
  widen read each scale back to decide its dtype);
- host threads other than the one that launches kernels (a staging copier) have their own clocks;
  a host memcpy costs ``bytes / memcpy_Bps(threads)`` on its thread's clock (``host_memcpy_Bps``
  per copier thread the fill is split over, up to ``host_memcpy_max_Bps``), times a seeded jitter
  (``copier_jitter``, zero-mean) and a slow stretch (``copier_slow``: the copier at a fraction of
  its speed between two instants), as page faults, the GIL and a busy memory bus do;
- the launch thread's waits for the copier count as blocked (``blocked_s``, ``copier_wait_s``).

Used only by tests and benches (``bench/sim_overlap.py``); nothing in the service imports it (an
import contract in ``pyproject.toml``).

Bandwidths are :class:`SimLink` inputs; per-layer compute times are attached with
:meth:`SimDevice.charge_layer_compute`. Every operation is also checked against the clock: a kernel
that reads a buffer before the copy into it landed, or a copy that overwrites a buffer a queued
kernel or copy still reads, raises :class:`StreamHazardError`: the data on the CPU is computed in
program order and would hide such a race, the clock does not.
"""
from __future__ import annotations

import contextlib
import enum
import logging
import random
from dataclasses import dataclass
from typing import Iterable, Iterator, Mapping

import torch

from offload_core.fp8_widen import WidenMode
from offload_core.host.pinned import HostBuffer, PinRefusal
from offload_core.host.tier import HostingTier
from offload_core.layout import FP8_HOST_DTYPE
from offload_core.streaming.device import Device, DeviceCapacity
from testing.sim_link import SimLink, SlowStretch
from testing.sim_sms import SmTimeline
from testing.sim_threads import LAUNCH_THREAD, InterceptCopies, SimCopier

__all__ = ["LAUNCH_THREAD", "SimDevice", "SimEvent", "SimLink", "SimStream", "SlowStretch", "StreamHazardError"]

logger = logging.getLogger(__name__)

# Two operations touching one buffer may meet exactly at an instant; float sums of durations can
# differ in the last bits, so a hazard needs an overlap of more than a femtosecond.
_EPSILON_S = 1e-15
SIM_PIN_REFUSED = 2  # CUDA_ERROR_OUT_OF_MEMORY, what cuMemHostRegister returns past a memlock limit


class StreamHazardError(AssertionError):
    """An operation would touch a buffer before (or while) another one on the clock still does.

    An AssertionError: a broken ordering invariant of the engine, never a copy fault, so the
    engine's fault handling (which wraps copy errors in CopyFailed) lets it through unchanged.
    """


@dataclass(frozen=True)
class SimEvent:
    """A recorded stream position: the virtual time its stream's queued work completes."""

    time: float


class SimStream(enum.Enum):
    COMPUTE = "compute"  # the current stream: kernels, and what the engine records as compute
    COPY = "copy"  # the side stream host->device copies run on
    WIDEN = "widen"  # the side stream FP8 layers are widened on


def _storage(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


Span = tuple[int, int]  # the bytes [lo, hi) an operation touches


def _span(tensor: torch.Tensor) -> Span:
    """The address range ``tensor``'s elements lie in (a strided view's holes included)."""
    lo = tensor.data_ptr()
    if tensor.numel() == 0:
        return lo, lo
    extent = 1 + sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride()))
    return lo, lo + extent * tensor.element_size()


def _latest(times: dict[Span, float], span: Span) -> float:
    """The latest time among ``times`` entries overlapping ``span`` (0 if none)."""
    lo, hi = span
    return max((t for (a, b), t in times.items() if a < hi and lo < b), default=0.0)


class SimDevice(Device):
    """A CPU-backed device with CUDA's copy, kernel and event timing on a virtual clock."""

    def __init__(self, link: SimLink | None = None, facts: DeviceCapacity | None = None, refuse_pins: bool = False):
        super().__init__(torch.device("cpu"), facts or DeviceCapacity())
        self.link = link or SimLink()
        self.refuse_pins = refuse_pins  # a memlock limit: every staging pin refused
        self._ready = {SimStream.COMPUTE: 0.0, SimStream.COPY: 0.0, SimStream.WIDEN: 0.0}
        self._stream = SimStream.COMPUTE
        self._h2d_free = 0.0  # the one host->device copy engine
        self._sms = SmTimeline()  # the compute time kernels on every stream share
        self._clocks = {LAUNCH_THREAD: 0.0}
        self._thread = LAUNCH_THREAD
        self._memcpy_threads = 1  # threads the running host memcpy is split over (SimCopier.copy)
        self._host_memory: dict[int, HostingTier] = {}
        # By byte range, not storage: one allocation holds many layers (the ring's window, the
        # staging ring), and a copy into one layer's place must not be taken for one into another's.
        self._last_write: dict[Span, float] = {}
        self._last_read: dict[Span, float] = {}
        self.copies = 0
        self.kernels = 0
        self.syncs = 0  # host waits for a stream (charge_widen's scale reads)
        self.blocked_s = 0.0  # launch-thread time blocked: in host-blocking copies and waiting for the copier
        self.copier_wait_s = 0.0  # of blocked_s, the launch thread's waits for staging fills
        self.copy_blocked_s = 0.0  # of blocked_s, time inside host-blocking copies (pageable, mapped, synchronous)
        self._rng = random.Random(self.link.seed)

    # -- the clock --------------------------------------------------------------------------------
    @property
    def now(self) -> float:
        """The launch thread's virtual time."""
        return self._clocks[LAUNCH_THREAD]

    def stream_ready(self, stream: SimStream) -> float:
        return self._ready[stream]

    def register_host_memory(self, tensors: Iterable[torch.Tensor], tier: HostingTier) -> None:
        """Say which memory copies read from; unregistered host memory is PAGEABLE (CUDA's rule)."""
        for tensor in tensors:
            self._host_memory[_storage(tensor)] = tier

    def register_streamer(self, streamer) -> None:
        """Register every streamed layer's host copy under its hosting tier."""
        for layer in streamer.layers:
            self.register_host_memory(layer.host_tensors(), layer.tier)

    def charge_layer_compute(self, streamer, seconds: Mapping[str, float], kernels: int = 1,
                             host_s: float = 0.0) -> list:
        """Launch ``kernels`` kernels of ``seconds[layer.key]`` in all whenever a layer runs, after
        ``host_s`` of the launch thread's time (its hooks); returns the hook handles.

        The hook runs before the engine's own post-hook (``prepend``): the kernels are queued while
        the layer's weights are still bound, so they read them, and the engine's last-use event
        for the slot is recorded after them, as on a GPU.
        """
        missing = sorted({layer.key for layer in streamer.layers} - set(seconds))
        if missing:
            raise ValueError(f"charge_layer_compute: no compute time for layers {missing}")
        if kernels < 1 or host_s < 0:
            raise ValueError(f"charge_layer_compute: kernels must be >= 1 and host_s >= 0, got {kernels}, {host_s}")
        handles = []
        for layer in streamer.layers:
            def charge(_module, _args, _output, layer=layer):
                self._clocks[self._thread] += host_s
                self.launch_kernel(seconds[layer.key], [p for p in layer.params if p.numel() > 0], kernels)
            handles.append(layer.module.register_forward_hook(charge, prepend=True))
        return handles

    def charge_widen(self, streamer, launches: int, syncs: int = 0) -> int:
        """Charge every FP8 layer's widen: ``launches`` kernels on the stream it is issued on
        (``widen_Bps`` of its widened bytes in all) from the thread issuing it, and ``syncs`` waits of
        that thread for that stream. It reads the landing buffer and writes the layer's regions: both
        checked against the clock like a copy. Returns the layers charged. The widen itself still runs
        (the data stays exact)."""
        charged = 0
        for layer in streamer.layers:
            if not layer.layout.quantized:
                continue
            widened = sum(layer.layout.tensors[q.index].extent_bytes for q in layer.layout.quantized)
            dtypes = {layer.layout.tensors[q.index].dtype for q in layer.layout.quantized}
            original = layer.host.widen

            def timed(regions, how=WidenMode.EAGER, *, original=original, widened=widened, dtypes=dtypes):
                original(regions, how)
                stream = self._stream
                reads = (_span(regions[FP8_HOST_DTYPE]),)
                writes = tuple(_span(regions[dtype]) for dtype in dtypes)
                self._check(max(self._clocks[self._thread], self._ready[stream]), reads, writes, "a widen")
                seconds = widened / self.link.widen_Bps if self.link.widen_Bps else 0.0
                for n in range(launches):
                    self._launch(stream, seconds / launches)
                    if n < syncs:  # the scale read back: the thread waits for the stream so far
                        self._wait_for(stream)
                for _ in range(max(0, syncs - launches)):
                    self._wait_for(stream)
                self._touch(self._ready[stream], reads, writes)
            layer.host.widen = timed
            charged += 1
        return charged

    def launch_kernel(self, seconds: float, reads: Iterable[torch.Tensor] = (), kernels: int = 1) -> None:
        """Queue ``kernels`` kernels of ``seconds`` in all on the compute stream reading the tensors ``reads``."""
        start = max(self._clocks[self._thread], self._ready[SimStream.COMPUTE])
        spans = tuple(_span(t) for t in reads)
        self._check(start, reads=spans, writes=(), what=f"a {seconds:.3g} s kernel")
        for _ in range(kernels):
            self._launch(SimStream.COMPUTE, seconds / kernels)
        self._touch(self._ready[SimStream.COMPUTE], reads=spans, writes=())

    def _launch(self, stream: SimStream, seconds: float) -> None:
        """One kernel on ``stream``: it starts when the thread launches it and the stream reached it, and
        runs in the SMs' free time from then (``SmTimeline``); the launching thread pays ``launch_s``."""
        start = max(self._clocks[self._thread], self._ready[stream])
        self._sms.forget_before(min(self._clocks.values()))
        self._ready[stream] = self._sms.place(start, seconds)
        self._clocks[self._thread] += self.link.launch_s
        self.kernels += 1

    def _wait_for(self, stream: SimStream) -> None:
        """The calling thread blocks until ``stream``'s queued work is done (a device read back)."""
        clock = self._clocks[self._thread]
        waited = max(0.0, self._ready[stream] - clock)
        if self._thread == LAUNCH_THREAD:
            self.blocked_s += waited
        self._clocks[self._thread] = clock + waited
        self.syncs += 1

    def _h2d_copy(self, dst: torch.Tensor, src: torch.Tensor, non_blocking: bool = True) -> None:
        nbytes = dst.numel() * dst.element_size()
        source = self._host_memory.get(_storage(src), HostingTier.PAGEABLE)
        clock = self._clocks[self._thread]
        start = max(clock, self._ready[self._stream], self._h2d_free)
        self._check(start, reads=(_span(src),), writes=(_span(dst),), what=f"a {source.value} copy")
        end = start + self.link.copy_latency_s + nbytes / self.link.h2d_Bps(source)
        self._ready[self._stream] = end
        self._h2d_free = end
        self._touch(end, reads=(_span(src),), writes=(_span(dst),))
        if source is not HostingTier.PINNED or not non_blocking:
            # The driver stages pageable memory itself and returns only once the copy landed; a
            # pinned copy without non_blocking is synchronous too (cudaMemcpy, not ...Async).
            self.blocked_s += end - clock
            self.copy_blocked_s += end - clock
            clock = end
        self._clocks[self._thread] = clock + self.link.launch_s
        self.copies += 1

    def _host_memcpy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        nbytes = dst.numel() * dst.element_size()
        start = self._clocks[self._thread]
        self._check(start, reads=(_span(src),), writes=(_span(dst),), what="a host memcpy")
        end = start + self.link.memcpy_s(nbytes, start, self._rng, self._memcpy_threads)
        self._touch(end, reads=(_span(src),), writes=(_span(dst),))
        self._clocks[self._thread] = end

    def _check(self, start: float, reads: tuple[Span, ...], writes: tuple[Span, ...], what: str) -> None:
        for span in reads:
            landed = _latest(self._last_write, span)
            if landed > start + _EPSILON_S:
                raise StreamHazardError(f"{what} at t={start:.9f} s reads a buffer whose last write "
                                        f"lands at t={landed:.9f} s: a missing wait")
        for span in writes:
            busy = max(_latest(self._last_read, span), _latest(self._last_write, span))
            if busy > start + _EPSILON_S:
                raise StreamHazardError(f"{what} at t={start:.9f} s overwrites a buffer still in use "
                                        f"until t={busy:.9f} s: a missing wait")

    def _touch(self, end: float, reads: tuple[Span, ...], writes: tuple[Span, ...]) -> None:
        for span in reads:
            self._last_read[span] = max(self._last_read.get(span, 0.0), end)
        for span in writes:
            self._last_write[span] = end

    # -- the Device interface -----------------------------------------------------------------------
    def on_copy_stream(self) -> contextlib.AbstractContextManager[None]:
        return self.on_stream(SimStream.COPY)

    @contextlib.contextmanager
    def on_stream(self, stream: SimStream) -> Iterator[None]:
        """Host->device copies issued inside run on ``stream`` (the engine uses the copy stream)."""
        previous, self._stream = self._stream, stream
        try:
            with InterceptCopies(self, host_memcpy=False):
                yield
        finally:
            self._stream = previous

    def on_widen_stream(self) -> contextlib.AbstractContextManager[None]:
        return self.on_stream(SimStream.WIDEN)

    def record_widen(self) -> SimEvent:
        return SimEvent(self._ready[SimStream.WIDEN])

    def widen_waits(self, event: SimEvent | None) -> None:
        if event is not None:
            self._ready[SimStream.WIDEN] = max(self._ready[SimStream.WIDEN], event.time)

    def record_copy(self) -> SimEvent:
        return SimEvent(self._ready[SimStream.COPY])

    def record_compute(self) -> SimEvent:
        return SimEvent(self._ready[SimStream.COMPUTE])

    def compute_waits(self, event: SimEvent | None) -> None:
        if event is not None:
            self._ready[SimStream.COMPUTE] = max(self._ready[SimStream.COMPUTE], event.time)

    def copy_waits(self, event: SimEvent | None) -> None:
        if event is not None:
            self._ready[SimStream.COPY] = max(self._ready[SimStream.COPY], event.time)

    def copy_waits_for_compute(self) -> None:
        self.copy_waits(self.record_compute())

    def compute_waits_for_copies(self) -> None:
        self.compute_waits(self.record_copy())
        self.compute_waits(self.record_widen())

    def host_waits(self, event: SimEvent | None) -> None:
        """The calling host thread (a copier) blocks until ``event``'s stream reached it."""
        if event is not None:
            self._clocks[self._thread] = max(self._clocks[self._thread], event.time)

    def host_copier(self, name: str, threads: int | None = None) -> SimCopier:
        return SimCopier(self, name, threads or 1)

    def allocate_staging(self, nbytes: int) -> HostBuffer:
        """A staging buffer: page-locked on the simulated machine (copies from it are asynchronous),
        unless the device refuses pins (``refuse_pins``): then pageable, with the refusal, as CUDA's."""
        data = torch.empty(int(nbytes), dtype=torch.uint8)
        if self.refuse_pins:
            self.register_host_memory([data], HostingTier.PAGEABLE)
            return HostBuffer(data, int(nbytes), page_locked=False, refusal=PinRefusal(
                int(nbytes), SIM_PIN_REFUSED, "CUDA_ERROR_OUT_OF_MEMORY (simulated memlock limit)"))
        self.register_host_memory([data], HostingTier.PINNED)
        return HostBuffer(data, int(nbytes), page_locked=False)

    def free_staging(self, buffer: HostBuffer) -> None:
        self._host_memory.pop(_storage(buffer.data), None)

    def synchronize(self) -> None:
        """The launch thread waits for every stream (as ``torch.cuda.synchronize``)."""
        thread = self._thread
        self._clocks[thread] = max(self._clocks[thread], *self._ready.values())
