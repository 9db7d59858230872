"""The pinned staging ring: how PAGEABLE and MAPPED layers reach the device without blocking kernels.

On CUDA a copy from pageable or file-mapped memory is staged by the driver and blocks the calling
thread until it lands; issued from the thread that launches kernels, it serialises copy and
compute (the simulator measures a step at 1.5-2x max(copy, compute) that way). So such layers go
through one pinned host buffer of ``n x`` the largest staged layer's bytes, used as a byte ring:
each fill takes its own layer's bytes, contiguous, after the previous one (wrapping), so the
copier runs as many small layers ahead as fit, not a fixed count (FLUX's single blocks are less
than half a double block: two buffers' worth holds four of them ahead, not two):

1. a host copier thread fills the ring in the order the engine will ask for the layers (once
   per use the staged resident layers, then the staged streamed layers cyclically), as far ahead
   as the bytes allow, each fill split over ``copier_threads`` (``copier.FillSplitter``);
2. when the launch thread needs a staged layer it waits for that fill (normally long done),
   issues the asynchronous copy from pinned memory on the copy stream and records its event;
3. the bytes go back to the copier, whose next fill over them first waits for that event: the
   copier, never the launch thread, waits for the copy to land.

Host bytes: exactly ``n x`` the region bytes (``staging_bytes``), page-locked, allocated once
and freed by ``close()`` after every copy out of it landed. A refused pin frees it: a pageable
staging buffer would add a host memcpy to a copy that blocks anyway, so the ring then stages
nothing (``refusal`` says why) and the engine copies those layers unstaged.

Faults: every byte goes back on every path. A fill that raised frees its bytes and its error
reaches the launch thread only when it needs that layer (a fill made ahead and dropped is logged).
A fill waited for longer than ``timeout_s`` raises :class:`FillTimeout`; its bytes stay out until
the stuck job ends, the fills queued behind it are cancelled, and a new copier thread takes over,
so the next request stages through the rest of the ring (no room: copied unstaged).
"""
from __future__ import annotations

import collections
import functools
import logging
from typing import Mapping, NamedTuple, Protocol, Sequence

import torch

from offload_core.buffers import DEFAULT_STAGING_BUFFERS, RegionMap
from offload_core.host.pinned import HostBuffer, PinRefusal
from offload_core.layout import LayerLayout
from offload_core.streaming.copier import CopyJob, FillTimeout, HostCopier
from offload_core.streaming.copy_log import CopyLog
from offload_core.streaming.device import Device
from offload_core.streaming.host_layer import HostLayer

logger = logging.getLogger(__name__)

COPIER_NAME = "offload-staging"
# How long the launch thread waits for one fill before the call fails (FillTimeout). 30 s: a fill
# is one layer's memcpy (a 1.2 GiB FLUX double block at ~5 GB/s from a cold page cache is ~0.25 s),
# so only a hung file mapping gets near it; the service's device_timeout_s is also 30 s.
DEFAULT_FILL_TIMEOUT_S = 30.0


class StagedLayer(Protocol):
    host: HostLayer

    @property
    def layout(self) -> LayerLayout: ...


class _Fill(NamedTuple):
    layer: StagedLayer
    start: int  # its bytes in the ring: [start, end)
    end: int
    carved: dict[torch.dtype, torch.Tensor]
    job: CopyJob


def _overlap(a0: int, a1: int, b0: int, b1: int) -> bool:
    return a0 < b1 and b0 < a1


def cut_ranges(out: list[tuple[int, int, object]], start: int, end: int) -> list[tuple[int, int, object]]:
    """``out`` (disjoint byte ranges, each with the event of the last copy out of it) without the bytes
    [start, end), which a new copy into them has waited for. The ranges stay disjoint, so the list never
    holds more of them than there are buffers (staging fills here, device slots in ring.py)."""
    kept = []
    for a, b, event in out:
        if not _overlap(a, b, start, end):
            kept.append((a, b, event))
            continue
        if a < start:
            kept.append((a, start, event))
        if end < b:
            kept.append((end, b, event))
    return kept


class StagingRing:
    """Pinned staging buffers and the copier that fills them ahead of the launch thread."""

    def __init__(self, device: Device, staged: Sequence[StagedLayer], cycle: Sequence[StagedLayer],
                 n_buffers: int = DEFAULT_STAGING_BUFFERS, timeout_s: float = DEFAULT_FILL_TIMEOUT_S,
                 copier_threads: int | None = None):
        self._device = device
        self._copier_threads = copier_threads  # None: the device's choice (Device.host_copier)
        self._timeout_s = timeout_s
        self._staged = {id(layer) for layer in staged}
        self._cycle = tuple(cycle)  # the staged streamed layers, in streamed order
        self._cycle_index = {id(layer): i for i, layer in enumerate(self._cycle)}
        self.regions = RegionMap.covering((layer.layout for layer in staged), host=True)  # 8-bit where hosted so
        self.n_buffers = min(n_buffers, len(staged))  # the ring's bytes, in largest staged layers
        self._own = {id(layer): RegionMap.covering([layer.layout], host=True) for layer in staged}
        self._buffers: list[HostBuffer] = []  # the one ring buffer, once allocated
        self._head = 0  # where the next fill starts (or 0, if it does not fit before the end)
        self._out: list[tuple[int, int, object]] = []  # bytes copied out: (start, end, the copy's event)
        self._pending: collections.deque[_Fill] = collections.deque()
        self._late: list[_Fill] = []  # fills given up on (timed out, interrupted): bytes back once done
        self._prologue: collections.deque[StagedLayer] = collections.deque()
        self._next = 0  # index in the cycle of the next layer to fill
        self._copier: HostCopier | None = None
        self.fills = 0
        self.restarts = 0  # requests out of the fill order (cold starts, layers run out of order)
        self.refusal: PinRefusal | None = None  # the driver refused to lock a buffer: nothing staged
        self.unstaged_copies = 0  # staged layers copied directly: every buffer was out (a hung fill)
        self.dropped_failures = 0  # fills made ahead that failed and were dropped unasked (logged)
        self._retired_cpu_s = 0.0  # CPU seconds of copiers replaced after a timeout
        self.copy_log: CopyLog | None = None  # a warm-up's record of each copy (LayerStreamer.trace_copies)

    @property
    def staging_bytes(self) -> int:
        """Page-locked host bytes of the staging ring (``buffers.staging_bytes``, exactly)."""
        return self.n_buffers * self.regions.nbytes

    def host_tensors(self) -> tuple[torch.Tensor, ...]:
        """The staging ring's buffer, once allocated (for the residency report)."""
        return tuple(buffer.data for buffer in self._buffers)

    @property
    def filled_ahead(self) -> int:
        """Fills made and not yet copied out."""
        return len(self._pending)

    @property
    def copier_cpu_s(self) -> float:
        """CPU seconds the copier thread(s) used for fills so far."""
        return self._retired_cpu_s + (self._copier.cpu_s if self._copier is not None else 0.0)

    @property
    def copier_threads(self) -> int:
        """Threads each fill is split over (the copier's, once allocated; else as configured, 1 if unset)."""
        if self._copier is not None:
            return self._copier.threads
        return self._copier_threads or 1

    @property
    def buffers_out(self) -> int:
        """Fills given up on whose bytes are still held (0 when the ring is whole)."""
        return len(self._late)

    def stages(self, layer: StagedLayer) -> bool:
        return id(layer) in self._staged and self.refusal is None

    def allocate(self) -> None:
        """Allocate the ring buffer and start the copier, once (they live until ``close``)."""
        if self._buffers or not self.n_buffers:
            return
        buffer = self._device.allocate_staging(self.staging_bytes)
        if buffer.refusal is not None:
            self._device.free_staging(buffer)
            self.refusal, self.n_buffers = buffer.refusal, 0
            logger.info("staging on %s: %s; %d pageable/mapped layers are copied unstaged (a pageable "
                        "staging buffer would add a host memcpy to a copy that blocks anyway)",
                        self._device.device, buffer.refusal.explain(), len(self._staged))
            return
        self._buffers = [buffer]
        self._head, self._out = 0, []
        self._copier = self._device.host_copier(COPIER_NAME, self._copier_threads)
        sizes = [own.nbytes for own in self._own.values()]
        logger.info("staging on %s: one pinned ring of %d B (%d x the largest staged layer, %d B) for %d "
                    "pageable/mapped layers of %d-%d B: %d-%d fills ahead, each split over %d copier threads",
                    self._device.device, self.staging_bytes, self.n_buffers, self.regions.nbytes, len(self._staged),
                    min(sizes), max(sizes), self.staging_bytes // max(sizes), self.staging_bytes // max(1, min(sizes)),
                    self.copier_threads)

    def begin(self, prologue: Sequence[StagedLayer] = ()) -> None:
        """Start a use: fill ``prologue`` (staged resident layers, in arm order), then the cycle from its start."""
        if not self.n_buffers:
            return
        self.allocate()
        self._drain()
        self._prologue = collections.deque(prologue)
        self._next = 0
        self._top_up()

    def stop(self) -> None:
        """End a use: wait for the fills in flight and forget the order."""
        self._drain()
        self._prologue.clear()
        self._next = 0

    def ready(self, layer: StagedLayer) -> bool:
        """Whether :meth:`copy_to` of ``layer`` would not wait for the copier: its fill, next in line,
        is done (a layer not next in line is refilled by ``copy_to``, which waits: True, as asked)."""
        return not self._pending or self._pending[0].layer is not layer or self._pending[0].job.done()

    def copy_to(self, layer: StagedLayer, regions: Mapping[torch.dtype, torch.Tensor]) -> int:
        """Inside the copy-stream context: copy ``layer``'s hosted bytes to device ``regions`` from its
        staging buffer (8-bit ones into the landing buffer: the caller widens them, on its stream).

        Its fill's error is raised here; past ``timeout_s`` a :class:`FillTimeout`. Every buffer
        that was waited for goes back (or, still being filled, out until its job ends).
        """
        if not self._pending or self._pending[0].layer is not layer:
            self._restart(layer)
        if not self._pending:
            # The ring's room is held by fills given up on: this layer goes the driver's blocking way.
            self.unstaged_copies += 1
            logger.info("staging: no room (%d fills given up on hold it); %s copied unstaged",
                        len(self._late), getattr(layer, "key", "?"))
            return layer.host.copy_host_bytes(regions)
        fill = self._pending.popleft()
        self._wait(fill)  # the launch thread waits for the host copier only when it fell behind
        if self.copy_log is not None:
            self.copy_log.begin()  # the DMA starts now: the wait for the fill is the copier's, not the copy's
        staged = fill.carved
        copied = 0
        try:
            for dtype, nbytes in layer.layout.host_flat_bytes:
                regions[dtype][:nbytes].copy_(staged[dtype][:nbytes], non_blocking=True)
                copied += nbytes
        finally:  # a copy issued (even in part) is waited for before its bytes are filled again
            self._out.append((fill.start, fill.end, self._device.record_copy()))
        self._top_up()
        return copied

    def close(self) -> None:
        """Wait for every fill and every copy out of the buffers, then unlock and drop them.

        A fill still hung after ``timeout_s`` keeps its buffer locked (freed with the process):
        unlocking pages a thread still writes would be worse; the copier is left to end with it.
        """
        self._drain()
        stuck = self._settle_late(self._timeout_s)
        for _, _, event in self._out:
            self._device.host_waits(event)
        if stuck:
            logger.warning("staging: %d fills still hung after %.1f s; the ring is left locked", stuck,
                           self._timeout_s)
        else:
            for buffer in self._buffers:
                self._device.free_staging(buffer)
        if self._copier is not None:
            self._retired_cpu_s += self._copier.cpu_s
            self._copier.close(wait=not stuck)
        self._buffers, self._out, self._late, self._head = [], [], [], 0
        self._copier = None

    def _restart(self, layer: StagedLayer) -> None:
        """Asked out of the fill order: drop what was filled ahead and continue from ``layer``."""
        if self._pending:
            self.restarts += 1
            log = logger.info if self.restarts == 1 else logger.debug
            log("staging: %s asked while %s were filled ahead; refilling from it (occurrence %d)",
                getattr(layer, "key", "?"), [getattr(f.layer, "key", "?") for f in self._pending], self.restarts)
        self.allocate()
        self._drain()
        index = self._cycle_index.get(id(layer))
        if index is None:
            self._prologue = collections.deque([layer])
        else:
            self._prologue.clear()
            self._next = index
        self._top_up()

    def _drain(self) -> None:
        """Wait (bounded) for every fill in flight; their bytes go back unread, errors logged."""
        while self._pending:
            fill = self._pending.popleft()
            try:
                self._wait(fill)
            except Exception as error:  # a fill made ahead that no layer asked for (yet): not this call's
                self.dropped_failures += 1
                logger.warning("staging: fill of %s made ahead failed (%s: %s); dropped, filled again "
                               "when asked", getattr(fill.layer, "key", "?"), type(error).__name__, error)

    def _wait(self, fill: _Fill) -> None:
        """Wait for ``fill``; on its error its bytes are freed, past the bound the copier replaced."""
        try:
            fill.job.result(timeout=self._timeout_s)
        except BaseException as error:
            if not fill.job.done():  # timed out, or this thread interrupted: the job still writes
                self._late.append(fill)
                if isinstance(error, TimeoutError):
                    self._abandon_copier(fill)
                    raise FillTimeout(f"staging fill of layer {getattr(fill.layer, 'key', '?')} not done "
                                      f"after {self._timeout_s:.1f} s (fill_timeout_s); a hung host "
                                      "mapping? the copier was replaced and its bytes set aside") from None
            raise

    def _abandon_copier(self, stuck: _Fill) -> None:
        """The copier is stuck in ``stuck``: cancel the fills queued behind it, start a new thread."""
        for fill in self._pending:
            if not fill.job.cancel():  # queued behind the stuck one and never started: its bytes are free
                self._late.append(fill)
        self._pending.clear()
        old, self._copier = self._copier, self._device.host_copier(COPIER_NAME, self._copier_threads)
        self._retired_cpu_s += old.cpu_s
        old.close(wait=False)
        logger.warning("staging: fill of %s timed out after %.1f s; %d fills' bytes set aside until they "
                       "end, a new copier thread fills the rest of the ring", getattr(stuck.layer, "key", "?"),
                       self._timeout_s, len(self._late))

    def _reclaim(self) -> None:
        """Bytes of fills given up on come back once their jobs ended."""
        if not self._late:
            return
        done = [fill for fill in self._late if fill.job.done()]
        for fill in done:
            self._late.remove(fill)
        if done:
            logger.info("staging: %d fills given up on ended, their bytes are back; %d still out",
                        len(done), len(self._late))

    def _settle_late(self, timeout_s: float) -> int:
        """Wait up to ``timeout_s`` for fills given up on; how many still hold bytes after it."""
        for fill in self._late:
            if not fill.job.cancel():
                try:
                    fill.job.result(timeout=timeout_s)
                except Exception as error:  # its caller was told already; only the bytes matter
                    logger.debug("staging: fill given up on ended with %s", type(error).__name__)
        self._reclaim()
        return len(self._late)

    def _peek(self) -> StagedLayer | None:
        if self._prologue:
            return self._prologue[0]
        return self._cycle[self._next] if self._cycle else None

    def _advance(self) -> None:
        if self._prologue:
            self._prologue.popleft()
        else:
            self._next = (self._next + 1) % len(self._cycle)

    def _room(self, nbytes: int) -> int | None:
        """Where ``nbytes`` of the next fill go: after the last fill, or at 0 if not before the end; None if held."""
        start = self._head if self._head + nbytes <= self.staging_bytes else 0
        held = [*self._pending, *self._late]
        if any(_overlap(start, start + nbytes, f.start, f.end) for f in held):
            return None
        return start

    def _top_up(self) -> None:
        """Fill ahead in order while the next layer's bytes fit beside the fills held."""
        self._reclaim()
        while True:
            layer = self._peek()
            if layer is None:
                return
            own = self._own[id(layer)]
            start = self._room(own.nbytes)
            if start is None:
                return
            self._advance()
            end = start + own.nbytes
            # The copy stream runs in order: the last copy out of these bytes covers the earlier ones.
            overlapping = [event for a, b, event in self._out if _overlap(start, end, a, b)]
            self._out = cut_ranges(self._out, start, end)
            carved = own.carve(self._buffers[0].data[start:end])
            job = functools.partial(self._fill, self._copier, layer, carved, overlapping[-1] if overlapping else None)
            self._pending.append(_Fill(layer, start, end, carved, self._copier.submit(job)))
            self._head = end

    def _fill(self, copier: HostCopier, layer: StagedLayer, carved: dict[torch.dtype, torch.Tensor],
              last_copy_out) -> None:
        """On ``copier`` (the one it was submitted to, replaced or not): wait until the last copy out of
        these bytes landed, then fill them over its threads."""
        self._device.host_waits(last_copy_out)
        layer.host.copy_host_bytes(carved, copier.copy)
        self.fills += 1
