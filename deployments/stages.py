"""The three stage deployments: TextEncoder, Denoiser, VaeDecoder (names the k8s manifests use).

Each replica loads only its stage's components from the configured folder, runs them under
offload_core (:class:`deployments.offload.StageResidency`), leases its device working set for the
length of every call, and returns tensors (Ray's object store carries them, never JSON).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
import time
from dataclasses import dataclass
from typing import AsyncIterator, Callable

import ray
import torch
from ray import serve
from ray.serve.exceptions import RayServeException

from deployments import families
from deployments.families import FamilyFacts
from deployments.memory import CLUSTER_DEVICE_BUSY, DeviceBusy, open_replica_memory
from deployments.metrics import StageMetrics
from deployments.offload import StageResidency
from deployments.residency_board import ReplicaResidency, get_board
from deployments.spec import (
    DenoiseProgress,
    GenerationSpec,
    PipelineStage,
    StageOutput,
    StageStats,
)
from offload_core.host.replica_budget import HostBudgetSpec
from offload_core.planner.search import PerformanceMode

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class StageConfig:
    """What one stage replica needs; built by ``deployments.app.build_app``."""

    app_name: str
    facts: FamilyFacts
    stage: PipelineStage
    mode: PerformanceMode
    # Forward passes per request of each of the stage's components (the planner weighs bytes by it).
    uses_per_request: tuple[tuple[str, int], ...]
    dtype: str
    # How long a call waits for its device working set before answering 503 (Retry-After).
    device_timeout_s: float
    # The stage's per-replica host_memory_budget (bytes or a fraction of spendable RAM); None: unset.
    host_budget: HostBudgetSpec | None = None


class RequestCancelled(RuntimeError):
    """The request's client went away; its call stopped at a step boundary (nobody reads the answer)."""


class CancelFlag:
    """One request's cancellation: set by whoever learns that its client left, checked by the
    Denoiser's step loop at every step boundary (Serve cancels the call's task, but it cannot
    interrupt the synchronous worker thread that runs the steps; this flag does)."""

    def __init__(self, request_id: str):
        self.request_id = request_id
        self._event = threading.Event()
        self.reason = ""
        self.stopped_at_step: int | None = None  # the boundary where the step loop saw the flag

    def cancel(self, reason: str) -> None:
        if not self._event.is_set():
            self.reason = reason
            self._event.set()

    @property
    def cancelled(self) -> bool:
        return self._event.is_set()

    def raise_if_cancelled(self, step: int) -> None:
        """Called at each step boundary (``step`` steps done): stop here if the request was cancelled."""
        if self._event.is_set():
            self.stopped_at_step = step
            raise RequestCancelled(f"request {self.request_id} cancelled after step {step}: {self.reason}")


def _replica_device() -> torch.device:
    # A replica is on the GPU only when Ray gave it one (num_gpus > 0, fractions allowed).
    if torch.cuda.is_available() and ray.get_gpu_ids():
        return torch.device("cuda", 0)
    return torch.device("cpu")


def _replica_id(stage: PipelineStage) -> str:
    try:
        return serve.get_replica_context().replica_id.to_full_id_str()
    except (RuntimeError, RayServeException):  # constructed outside Serve (benchmarks, unit tests of a worker)
        return f"local-{stage.value}"


class StageWorker:
    """Loads one stage, runs its calls under offload_core and the device lease, publishes residency."""

    def __init__(self, config: StageConfig):
        self.config = config
        self.device = _replica_device()
        self.replica = _replica_id(config.stage)
        self.pipe = families.load_stage_pipeline(config.facts, config.stage, DTYPES[config.dtype])
        self.memory = open_replica_memory(self.replica, self.device)
        budget = config.host_budget.resolve(self.memory.node.ram.spendable) if config.host_budget else None
        if budget is not None:
            logger.info("%s: host_memory_budget %s = %d B on this node (%d B spendable)", self.replica,
                        config.host_budget.describe(), budget, self.memory.node.ram.spendable)
        self.residency = StageResidency(
            config.stage.value, families.stage_modules(self.pipe, config.facts, config.stage),
            dict(config.uses_per_request), config.mode, self.device,
            device_capacity=self.memory.device_budget.capacity(), host_budget=self.memory.host_budget,
            owner=self.replica, host_budget_bytes=budget)
        self.metrics = StageMetrics(config.stage.value)
        # One call at a time per replica: the pipeline object (scheduler state) is not reentrant.
        self._lock = threading.Lock()
        self._last = StageStats(config.stage.value, self.replica, 0.0, 0, 0)
        self._board = None
        # Reports are built after the response is on its way: one reads /proc/self/maps and walks
        # every tensor (a few ms per call on the tiny zoo, more on a 14B model).
        self._publisher = concurrent.futures.ThreadPoolExecutor(1, f"publish-{config.stage.value}")
        self.publish()

    @property
    def busy(self) -> bool:
        """A call holds this replica (its pipeline and its device working set)."""
        return self._lock.locked()

    def run(self, work: Callable[[], object]) -> StageOutput:
        with self._lock, self._working_set():
            start = time.perf_counter()
            self.residency.prepare_for_use()
            try:
                value = work()
            finally:
                self.residency.finish_use()
            stats = StageStats(self.config.stage.value, self.replica, time.perf_counter() - start,
                               self.residency.bytes_streamed(), self.residency.device_peak_bytes())
        self.metrics.record(stats)
        self._last = stats
        self._publisher.submit(self.publish)
        return StageOutput(value, stats)

    @contextlib.contextmanager
    def _working_set(self):
        """Lease the predicted peak device bytes for the call (bounded wait, then DeviceBusy)."""
        try:
            with self.memory.device_working_set(self.residency.predicted_peak_bytes(),
                                                self.config.device_timeout_s) as lease:
                yield lease
        except CLUSTER_DEVICE_BUSY as exc:
            raise DeviceBusy.from_cluster(exc) from None

    def report(self) -> ReplicaResidency:
        weights = self.residency.report()
        return ReplicaResidency(self.replica, self.config.stage.value, str(self.device), self.config.mode.value,
                                self.residency.plan.explain(), self.residency.predicted_peak_bytes(),
                                self._last.device_peak_bytes, self._last.bytes_streamed, weights.to_json(),
                                self.residency.host_status(weights).to_json())

    def close(self) -> None:
        """Replica shutdown: unhook the engine and give back every lease this replica holds."""
        self._publisher.shutdown(wait=True)
        self.residency.remove()
        logger.info("%s: shut down, released %d B of leases", self.replica, self.memory.close())

    def publish(self) -> None:
        if not ray.is_initialized():
            return
        if self._board is None:
            self._board = get_board(self.config.app_name)
        with self._lock:  # never while a call is moving the weights the report walks
            report = self.report()
        self._board.publish.remote(report)  # fire and forget: a report is not worth a wait


@serve.deployment(name="TextEncoder")
class TextEncoder:
    def __init__(self, config: StageConfig):
        self.worker = StageWorker(config)

    def encode(self, spec: GenerationSpec) -> StageOutput:
        worker = self.worker
        return worker.run(lambda: families.encode(worker.pipe, worker.config.facts, spec, worker.device))

    def residency(self) -> ReplicaResidency:
        return self.worker.report()

    def __del__(self):  # Serve calls it on graceful replica shutdown
        if hasattr(self, "worker"):
            self.worker.close()


class _Failed:
    def __init__(self, error: BaseException):
        self.error = error


@serve.deployment(name="Denoiser")
class Denoiser:
    def __init__(self, config: StageConfig):
        self.worker = StageWorker(config)
        self.in_flight: dict[str, CancelFlag] = {}  # request id -> its flag, while its call runs
        self.last_cancelled: CancelFlag | None = None

    async def denoise(self, encoded: StageOutput, spec: GenerationSpec) -> AsyncIterator[DenoiseProgress | StageOutput]:
        """Streams ``DenoiseProgress`` after every step, then the latents as the last item.

        The steps run in a worker thread. If this generator is closed early (the caller was
        cancelled: Serve throws ``CancelledError`` in here when the client disconnects), the
        request's :class:`CancelFlag` is set and the step loop stops at the next step boundary,
        which gives the replica and its device lease back.
        """
        flag = CancelFlag(spec.request_id)
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        worker, prompt = self.worker, encoded.value

        def put(item) -> None:
            loop.call_soon_threadsafe(events.put_nowait, item)

        def on_step(progress: DenoiseProgress) -> None:
            flag.raise_if_cancelled(progress.step)
            put(progress)

        def work() -> None:
            try:
                put(worker.run(lambda: families.denoise(worker.pipe, worker.config.facts, prompt, spec, worker.device,
                                                        on_step=on_step)))
            except RequestCancelled as exc:  # nobody waits for an answer: say so, and why, once
                logger.info("%s: %s; replica free (lease and call lock given back)", worker.replica, exc)
            except BaseException as exc:  # re-raised below, in the caller's task
                put(_Failed(exc))

        self.in_flight[spec.request_id] = flag
        thread = threading.Thread(target=work, name=f"denoise-{spec.request_id}", daemon=True)
        thread.start()
        try:
            while True:
                item = await events.get()
                if isinstance(item, _Failed):
                    raise item.error
                yield item
                if isinstance(item, StageOutput):
                    return
        finally:
            del self.in_flight[spec.request_id]
            if thread.is_alive():  # closed early: the caller is gone
                flag.cancel("the caller went away")
                self.last_cancelled = flag
                logger.info("%s: request %s cancelled by its caller; the step loop stops at the next step "
                            "boundary", worker.replica, spec.request_id)

    def residency(self) -> ReplicaResidency:
        return self.worker.report()

    def __del__(self):  # Serve calls it on graceful replica shutdown
        if hasattr(self, "worker"):
            self.worker.close()


@serve.deployment(name="VaeDecoder")
class VaeDecoder:
    def __init__(self, config: StageConfig):
        self.worker = StageWorker(config)

    def decode(self, latents: StageOutput, spec: GenerationSpec) -> StageOutput:
        worker = self.worker
        return worker.run(lambda: families.decode(worker.pipe, worker.config.facts, latents.value, spec))

    def residency(self) -> ReplicaResidency:
        return self.worker.report()

    def __del__(self):  # Serve calls it on graceful replica shutdown
        if hasattr(self, "worker"):
            self.worker.close()
