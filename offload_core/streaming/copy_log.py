"""When each layer's host->device copy ran on the copy stream, for a warm-up's measured pass.

Off unless a warm-up attaches one (``LayerStreamer.trace_copies``): a request never pays for it.
The ring marks the start of a copy just before its bytes are issued and the end just after, on
the copy stream; a staged layer's start is marked again once its host fill is ready, so the span
is the DMA's, not the copier thread's (which the plan's picture draws on its own lane when
predicted). On CUDA a mark is a timing event recorded on the copy stream (the copy runs later, on
the device), converted to the host's ``perf_counter`` clock through one reference event recorded
on an idle device; on CPU copies are synchronous and a mark is ``perf_counter`` itself. Runs in
the process that streams (a stage replica's warm-up).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class CopySpan:
    """One layer's copy, in seconds on the host's ``time.perf_counter`` clock."""

    key: str
    start_s: float
    end_s: float


class CopyLog:
    """The copies one streamer issues while attached (see the module docstring)."""

    def __init__(self, device: torch.device):
        self._cuda = device.type == "cuda"
        self._device = device
        self._open: object | None = None
        self._marks: list[tuple[str, object, object]] = []
        if self._cuda:
            torch.cuda.synchronize(device)  # idle: the reference event runs as it is recorded
            self._reference = torch.cuda.Event(enable_timing=True)
            self._reference.record(torch.cuda.current_stream(device))
            self._reference_s = time.perf_counter()

    def _mark(self) -> object:
        if not self._cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()  # the current stream: the copy stream, inside Device.on_copy_stream
        return event

    def begin(self) -> None:
        """A copy's bytes are issued next (marked again by a staged copy once its fill is ready)."""
        self._open = self._mark()

    def end(self, key: str) -> None:
        """The copy of layer ``key`` is issued in full."""
        start, self._open = self._open, None
        self._marks.append((key, start if start is not None else self._mark(), self._mark()))

    def spans(self) -> tuple[CopySpan, ...]:
        """Every copy logged, in issue order (waits for the device's copies on CUDA)."""
        if not self._cuda:
            return tuple(CopySpan(key, start, end) for key, start, end in self._marks)
        torch.cuda.synchronize(self._device)

        def seconds(event) -> float:
            return self._reference_s + self._reference.elapsed_time(event) / 1e3

        return tuple(CopySpan(key, seconds(start), seconds(end)) for key, start, end in self._marks)
