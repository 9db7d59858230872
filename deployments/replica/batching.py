"""Step-level batching: requests join a running batch at step boundaries and leave when done.

On the GPUs this project is for, streaming the DiT's weights is what bounds a Denoiser replica
(FLUX.1-dev in bf16 is ~24 GB of transformer, ~1 s per forward over PCIe Gen4). Requests that
share each forward pay for the weights once: one stream of the weights serves the whole batch.

:class:`StepBatch` is the synchronous core (``submit`` then ``step`` until idle), so tests can
pin an exact batch composition; :class:`StepBatcher` runs it in one thread for the service.
A request joins at the next boundary when its :class:`~deployments.models.steppers.BatchKey` matches the
running batch's and the batch has room (the configured maximum and ``fits``, the replica's
activation lease); otherwise it waits in FIFO order, for at most ``max_wait_s``.
"""
from __future__ import annotations

import collections
import concurrent.futures
import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable

import torch

from deployments.models.cancel import RequestCancelled
from deployments.models.steppers import Stepper, StepRequest

logger = logging.getLogger(__name__)

# An idle replica gathers companions for at most this fraction of one forward. A request that
# misses the gather joins one step late (it waits at most one forward), so a longer gather costs
# every request arriving alone more than it saves the late ones: the tiny Wan's forward takes
# ~5 ms, and the configured 10 ms gather doubled its denoise stage (bench/serve.py: 11.5 ms from
# the call to the first forward). A ~1 s FLUX.1-dev forward still gathers the full 10 ms.
GATHER_FRACTION_OF_FORWARD = 0.1


class BatchingError(RuntimeError):
    """Base of what a batched request can end with instead of latents."""


class QueueTimeout(BatchingError):
    """The request waited longer than ``max_wait_s`` for room in a compatible batch."""



@dataclass(frozen=True)
class BatchingConfig:
    max_batch: int = 4  # requests sharing one forward (each may bring n rows, doubled when guided)
    max_wait_s: float = 600.0  # a waiting request fails with QueueTimeout after this
    # When an idle replica gets a request, it waits this long for others before the first forward
    # (like Serve's batch_wait_timeout_s): requests sent together then share every step instead of
    # the later ones joining one step behind. 10 ms is 1 % of a ~1 s streamed FLUX.1-dev forward.
    # At most GATHER_FRACTION_OF_FORWARD of the last forward (StepBatch.gather_wait_s).
    gather_s: float = 0.01

    def __post_init__(self) -> None:
        if isinstance(self.max_batch, bool) or not isinstance(self.max_batch, int) or self.max_batch < 1:
            raise ValueError(f"max_batch must be an int >= 1, got {self.max_batch!r}")
        if not self.gather_s >= 0:
            raise ValueError(f"gather_s must be >= 0, got {self.gather_s!r}")
        if not self.max_wait_s > 0:
            raise ValueError(f"max_wait_s must be > 0, got {self.max_wait_s!r}")


@dataclass(frozen=True)
class ForwardFigures:
    """One step boundary's forward, for metrics and the residency board."""

    requests: int
    rows: int
    seconds: float
    bytes_streamed: int  # weights streamed for this forward: shared by every request in it


@dataclass(eq=False)
class _Entry:
    request: StepRequest
    future: concurrent.futures.Future
    queued_at: float


class StepBatch:
    """The running batch and its FIFO queue; ``step()`` runs one boundary: admit, forward, retire."""

    def __init__(self, stepper: Stepper, config: BatchingConfig = BatchingConfig(),
                 fits: Callable[[list[StepRequest]], bool] = lambda batch: True, clock: Callable[[], float] = time.monotonic,
                 bytes_streamed: Callable[[], int] = lambda: 0,
                 on_forward: Callable[[ForwardFigures], None] = lambda figures: None):
        self.stepper, self.config, self._fits, self._clock = stepper, config, fits, clock
        # A counter of weight bytes streamed so far (the engine's); each forward's share is split
        # evenly between the requests it served.
        self._bytes_streamed, self._on_forward = bytes_streamed, on_forward
        self.running: list[_Entry] = []
        self.waiting: collections.deque[_Entry] = collections.deque()
        self.forwards = 0  # transformer forwards run: one per boundary, whatever the batch size
        self.request_steps = 0  # request steps served, for the mean batch size
        self.last_forward_s: float | None = None  # None until the first forward ran

    def submit(self, request: StepRequest) -> concurrent.futures.Future:
        entry = _Entry(request, concurrent.futures.Future(), self._clock())
        self.waiting.append(entry)
        return entry.future

    @property
    def idle(self) -> bool:
        return not self.running and not self.waiting

    def gather_wait_s(self) -> float:
        """How long an idle replica waits for companions before its first forward: ``gather_s``, at
        most GATHER_FRACTION_OF_FORWARD of the last forward (the whole ``gather_s`` before any)."""
        if self.last_forward_s is None:
            return self.config.gather_s
        return min(self.config.gather_s, GATHER_FRACTION_OF_FORWARD * self.last_forward_s)

    @property
    def mean_batch(self) -> float:
        return self.request_steps / self.forwards if self.forwards else 0.0

    def step(self) -> int:
        """One step boundary, then its forward. Returns how many requests it served (0: none ran)."""
        self.boundary()
        return self.forward()

    def boundary(self) -> None:
        """Requests leave (cancelled, timed out) and join (FIFO, compatible, with room)."""
        self._drop_cancelled()
        self._admit()

    def forward(self) -> int:
        """One transformer forward for every running request, then each request's own step."""
        if not self.running:
            return 0
        batch = [e.request for e in self.running]
        start, streamed_before = self._clock(), self._bytes_streamed()
        try:
            with torch.no_grad():
                noise = self.stepper.forward(batch)
                for request, pred in zip(batch, noise):
                    request.advance(pred)
        except Exception as exc:  # the forward is shared: every request in it failed with it
            logger.error("batched forward of %d requests failed: %r", len(batch), exc)
            for entry in self.running:
                entry.future.set_exception(exc)
            self.running.clear()
            return len(batch)
        self.forwards += 1
        self.request_steps += len(batch)
        self.last_forward_s = self._clock() - start
        streamed = self._bytes_streamed() - streamed_before
        for request in batch:
            request.bytes_streamed += streamed / len(batch)
        self._on_forward(ForwardFigures(len(batch), sum(r.rows for r in batch), self.last_forward_s, streamed))
        for entry in [e for e in self.running if e.request.done]:
            self.running.remove(entry)
            entry.future.set_result(entry.request.latents)
        return len(batch)

    def cancel_all(self, error: BaseException) -> None:
        """Fail everything running or waiting (the replica is shutting down)."""
        for entry in [*self.running, *self.waiting]:
            if not entry.future.done():
                entry.future.set_exception(error)
        self.running.clear()
        self.waiting.clear()

    def _drop_cancelled(self) -> None:
        for pool in (self.running, self.waiting):
            for entry in [e for e in pool if e.request.cancel.cancelled]:
                pool.remove(entry)
                logger.info("request %s cancelled after %d of %d steps (%s); %d others carry on",
                            entry.request.spec.request_id, entry.request.step, len(entry.request.timesteps),
                            entry.request.cancel.reason, len(self.running))
                try:
                    entry.request.cancel.raise_if_cancelled(entry.request.step)
                except RequestCancelled as exc:
                    entry.future.set_exception(exc)
        now = self._clock()
        for entry in [e for e in self.waiting if now - e.queued_at > self.config.max_wait_s]:
            self.waiting.remove(entry)
            entry.future.set_exception(QueueTimeout(
                f"request {entry.request.spec.request_id} waited {now - entry.queued_at:.1f} s > "
                f"max_wait_s {self.config.max_wait_s} s for room in a batch"))

    def _admit(self) -> None:
        """FIFO: the head of the queue joins if compatible and there is room; an empty batch takes
        the head's key. A later compatible request never overtakes an incompatible head."""
        while self.waiting and len(self.running) < self.config.max_batch:
            head = self.waiting[0]
            if self.running and head.request.key != self.running[0].request.key:
                return
            candidate = [e.request for e in self.running] + [head.request]
            rows = sum(r.rows for r in candidate)
            if self.running and not self._fits(candidate):
                return  # the activation lease cannot cover it; it joins when others leave
            self.waiting.popleft()
            head.request.waited_s = self._clock() - head.queued_at
            self.running.append(head)
            logger.info("request %s joined the batch at a step boundary: %d requests, %d rows",
                        head.request.spec.request_id, len(self.running), rows)


class StepBatcher:
    """The service's loop: one thread runs ``StepBatch.step`` while anything runs or waits.

    ``around_busy`` wraps each busy period (from the first request to the batch going idle): the
    stage's prepare/finish and device lease, so the weights are armed once per busy period.
    """

    def __init__(self, batch: StepBatch, around_busy: Callable[[Callable[[], None]], None] = lambda run: run()):
        self.batch, self._around_busy = batch, around_busy
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="step-batcher", daemon=True)
        self._thread.start()

    def submit(self, request: StepRequest) -> concurrent.futures.Future:
        with self._lock:
            if self._closed:
                raise BatchingError("the batcher is closed")
            future = self.batch.submit(request)
            self._wake.notify()
        return future

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self.batch.cancel_all(BatchingError("the replica is shutting down"))
            self._wake.notify()
        self._thread.join()

    def _loop(self) -> None:
        while True:
            with self._lock:
                while self.batch.idle and not self._closed:
                    self._wake.wait()
                if self._closed:
                    return
            time.sleep(self.batch.gather_wait_s())  # outside the lock: others may submit meanwhile
            try:
                self._around_busy(self._run_busy)
            except Exception as exc:  # a failed prepare/lease fails what was waiting, not the loop
                logger.error("busy period failed before any step: %r", exc)
                with self._lock:
                    self.batch.cancel_all(exc)

    def _run_busy(self) -> None:
        while True:
            with self._lock:  # submissions land between boundaries, never inside a forward's admit
                if self.batch.idle or self._closed:
                    return
                self.batch.boundary()
            self.batch.forward()
