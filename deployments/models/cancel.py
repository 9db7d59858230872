"""Cancellation of one request: a flag its caller sets, checked by the Denoiser at step boundaries."""
from __future__ import annotations

import threading
import time


class RequestCancelled(RuntimeError):
    """The request's client went away (or its job was deleted); it left the batch at a step boundary."""


class CancelFlag:
    """One request's cancellation: set by whoever learns that its client left, checked by the
    batch at every step boundary (Serve cancels the call's task, but it cannot interrupt the
    thread that runs the steps; this flag does)."""

    def __init__(self, request_id: str):
        self.request_id = request_id
        self._event = threading.Event()
        self.reason = ""
        self.cancelled_after_step = 0  # steps done when the cancel arrived: where 'within one step' counts from
        self.cancelled_at_s = 0.0  # time.monotonic() then
        self.stopped_at_step: int | None = None  # the boundary where the batch saw the flag

    def cancel(self, reason: str, after_step: int = 0) -> None:
        if not self._event.is_set():
            self.reason, self.cancelled_after_step, self.cancelled_at_s = reason, after_step, time.monotonic()
            self._event.set()

    @property
    def cancelled(self) -> bool:
        return self._event.is_set()

    def raise_if_cancelled(self, step: int) -> None:
        """Called at each step boundary (``step`` steps done): stop here if the request was cancelled."""
        if self._event.is_set():
            self.stopped_at_step = step
            raise RequestCancelled(f"request {self.request_id} cancelled after step {step}: {self.reason}")
