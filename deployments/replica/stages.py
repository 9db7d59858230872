"""The three stage deployments: TextEncoder, Denoiser, VaeDecoder (names the k8s manifests use).

Each wraps one :class:`deployments.replica.worker.StageWorker` (loading, planning, leases, residency) and
returns tensors (Ray's object store carries them, never JSON). The encoder's and the decoder's calls
run on the replica's one :class:`deployments.replica.stage_thread.StageThread`, not Serve's pool.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import time
from typing import AsyncIterator, Callable

import torch
from ray import serve

from deployments.capacity.finish_model import work_seconds
from deployments.capacity.replica_report import ReplicaResidency
from deployments.capacity.work_autoscaling import REQUEST_S, REQUESTS, WORK_S, autoscaling_stats
from deployments.models import families
from deployments.models.cancel import CancelFlag, RequestCancelled
from deployments.models.lora_rows import LoraStepper
from deployments.models.registry import adapter_for
from deployments.models.steppers import StepRequest, stepper_for
from deployments.replica.batching import BatchingConfig, ForwardFigures, StepBatch, StepBatcher
from deployments.replica.load_tracker import tracker_for
from deployments.replica.logs import into_replica_log
from deployments.replica.metrics import BatchMetrics, WorkGauges
from deployments.replica.rank_spec import RankIdentity
from deployments.replica.stage_thread import StageThread
from deployments.replica.tensor_parallel.group import ShardGroup
from deployments.replica.tensor_parallel.ranked_denoiser import (
    RankedStageWorker,
    refuse_cached_request,
    refuse_step_cache,
)
from deployments.replica.worker import StageConfig, StageWorker, replica_id
from deployments.wire.spec import (
    DenoiseProgress,
    EditSource,
    GenerationSpec,
    NonFiniteOutput,
    RequestRejected,
    StageOutput,
    StageStats,
)

logger = logging.getLogger(__name__)


def encode_on(worker: StageWorker, spec: GenerationSpec) -> StageOutput:
    """One encode call on ``worker`` (the replica's own, or each rank's of a tensor-parallel replica)."""
    try:
        encoded = worker.run(lambda: families.encode(worker.pipe, worker.config.facts, spec, worker.device), spec)
    except (UnicodeError, TypeError) as exc:
        # The tokenizer is the only part that reads request text; it raises these on text it
        # cannot take (a lone surrogate was one, before validation refused them): the request's fault.
        raise RequestRejected("prompt", f"the tokenizer refused the prompt: {type(exc).__name__}: {exc}") from exc
    return StageOutput(encoded.value.packed(), encoded.stats)  # the Denoiser unpacks it


class RankedStage:
    """What the two stages that may span several GPUs (``tp_size > 1``: TextEncoder, Denoiser) answer of
    their ranks; ``group`` is None at tp_size 1."""

    group: ShardGroup | None = None

    def ranks(self) -> list[RankIdentity]:
        """Where each rank runs (pid, node, GPU); empty at tp_size 1."""
        return list(self.group.identities) if self.group is not None else []

    def check_health(self) -> None:
        """Serve's health check: at tp_size > 1 every rank must answer (a broken group fails it for good)."""
        if self.group is not None:
            self.group.check_health()


@serve.deployment(name="TextEncoder")
class TextEncoder(RankedStage):
    """At ``tp_size > 1`` the replica holds no model itself: its ranks do (deployments/replica/tensor_parallel/group.py)."""

    def __init__(self, config: StageConfig):
        into_replica_log()
        self.group = None
        if config.tp_size > 1:
            self.group = ShardGroup(config, replica_id(config.stage), config.tp_size)
        else:
            self.worker = StageWorker(config)
        self.thread = StageThread(config.stage.value)

    async def encode(self, spec: GenerationSpec) -> StageOutput:
        if self.group is not None:
            return await self.thread.call(self.group.call, encode_on, spec)
        return await self.thread.call(encode_on, self.worker, spec)

    def residency(self) -> ReplicaResidency:
        return self.group.reports()[0] if self.group is not None else self.worker.report()

    def __del__(self):  # Serve calls it on graceful replica shutdown
        if hasattr(self, "thread"):
            self.thread.close()
        if getattr(self, "group", None) is not None:
            self.group.close()
        elif hasattr(self, "worker"):
            self.worker.close()


# Marks the end of one request's progress events (its future is done).
_DONE = object()


@serve.deployment(name="Denoiser")
class Denoiser(RankedStage):
    """Step-level batching: compatible requests share each transformer forward (one stream of the
    weights per step boundary serves them all); each keeps its own scheduler, seed and progress."""

    def __init__(self, config: StageConfig):
        """At ``tp_size > 1`` the ranks hold the transformer and run its forwards
        (deployments/replica/tensor_parallel/ranked_denoiser.py); the batching stays here."""
        into_replica_log()
        self.group = None
        if config.tp_size > 1:
            refuse_step_cache(config)  # before any rank starts
            self.group = ShardGroup(config, replica_id(config.stage), config.tp_size)
            self.worker = RankedStageWorker(config, self.group, self.group.replica, self.group.close)
        else:
            self.worker = StageWorker(config)
        self.stepper = stepper_for(self.worker.pipe, config.facts, self.worker.device)
        if getattr(self.worker, "loras", None) is not None:  # each request's adapter on its own rows
            self.stepper = LoraStepper(self.stepper, self.worker.loras)
        batch = StepBatch(self.stepper, config.batching or BatchingConfig(), fits=self._fits,
                          bytes_streamed=self.worker.residency.bytes_streamed_so_far, on_forward=self._on_forward)
        self._leased_activation_bytes = 0  # what the running busy period leased for activations
        self.load = tracker_for(batch, self.worker)  # its routing stats (deployments/routing)
        self.batch_metrics = BatchMetrics(self.load.gpu_type)  # before the first forward, which records in it
        self.work_gauges = WorkGauges(self.load.gpu_type)
        self._request_s: float | None = None  # its seconds per request, from the last time it held any
        self.batcher = StepBatcher(batch, around_busy=self._busy_period)
        self.in_flight: dict[str, CancelFlag] = {}  # request id -> its flag, while its call runs
        self.last_spec: GenerationSpec | None = None
        self.last_cancelled: CancelFlag | None = None

    async def denoise(self, encoded: StageOutput, spec: GenerationSpec, progress: bool = True,
                      condition: StageOutput | None = None) -> AsyncIterator[DenoiseProgress | StageOutput]:
        """Streams ``DenoiseProgress`` after every step (unless ``progress`` is false), then the latents
        as the last item.

        Async, so a replica holds many requests at once while one thread runs the batch. A client
        that goes away cancels this generator; its request leaves the batch at the next boundary.
        """
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()

        def put(item) -> None:  # called from the batcher's thread
            loop.call_soon_threadsafe(events.put_nowait, item)

        started_at, start = time.time(), time.perf_counter()
        refuse_cached_request(self.worker.config, spec)
        edit = condition.value if condition is not None and isinstance(condition.value, EditSource) else None
        if (spec.strength is not None) != (edit is not None):  # a drive that skipped (or misplaced) the condition
            raise RuntimeError(f"request {spec.request_id}: an edit needs its source's latents from the decoder "
                               f"stage and only an edit takes them (strength {spec.strength}, source "
                               f"{type(edit).__name__})")
        value = encoded.value.unpacked()
        tokens = adapter_for(self.worker.config.facts).encoded_text_tokens(value)
        if tokens is not None:  # an unpadded prompt's length, which its activations grow with (Qwen-Image's)
            spec = dataclasses.replace(spec, text_tokens=tokens)
        self.worker.admit(spec)
        if condition is not None and edit is None:  # image-to-video: the reference image's condition
            value = dataclasses.replace(value, image_condition=condition.value)
        request = self.stepper.start(value, spec, on_step=put if progress else None)
        if edit is not None:  # an image edit: its image's latents, from the decoder, noised to its first step
            self.stepper.begin_edit(request, edit)
        default = self.worker.config.cache_threshold
        request.cache.threshold = default if spec.cache_threshold is None else spec.cache_threshold
        self.last_spec = spec  # batched requests share a shape: a busy period leases max_batch of it
        future = self.batcher.submit(request)
        future.add_done_callback(lambda _: put(_DONE))
        future.add_done_callback(lambda done: self._on_left(done, request.cancel))
        self.in_flight[spec.request_id] = request.cancel
        try:
            while (item := await events.get()) is not _DONE:
                if isinstance(item, DenoiseProgress) and item.ready is not None:
                    await asyncio.to_thread(item.ready.synchronize)  # the preview's bytes have landed
                yield item
            latents = future.result()
        finally:
            del self.in_flight[spec.request_id]
            if not future.done():  # closed early: the caller is gone; it leaves at the next boundary
                # Counted from the steps the batch had done when the cancel arrived, not from the last
                # progress event the caller read: those reach it through the event loop, a step late
                # when the loop is busy, and the disconnect is what "within one step" is measured from.
                request.cancel.cancel("the caller went away", after_step=request.step)
                self.last_cancelled = request.cancel
                logger.info("%s: request %s cancelled by its caller; it leaves the batch at the next step "
                            "boundary", self.worker.replica, spec.request_id)
        self.batch_metrics.record_wait(request.waited_s)
        worker = self.worker
        stats = StageStats(worker.config.stage.value, worker.replica, time.perf_counter() - start,
                           int(request.bytes_streamed), worker.residency.device_peak_bytes(), request.step,
                           request.cache.skipped, started_at)
        if request.cache.threshold > 0:
            logger.info("%s: request %s: step cache skipped the blocks after the first in %d of %d steps "
                        "(threshold %g); %d B streamed for it", worker.replica, spec.request_id,
                        request.cache.skipped, request.step, request.cache.threshold, stats.bytes_streamed)
        worker.record(stats)
        yield StageOutput(latents.to(families.CPU), stats).after(encoded)

    def _on_left(self, future, flag: CancelFlag) -> None:
        """A cancelled request left the batch (the batch's thread): record how soon, in steps and seconds."""
        if future.cancelled() or not isinstance(future.exception(), RequestCancelled):
            return
        steps, free_s = flag.stopped_at_step - flag.cancelled_after_step, time.monotonic() - flag.cancelled_at_s
        self.worker.metrics.record_cancel(steps, free_s)
        logger.info("%s: request %s left the batch %.3f s after its cancel, %d step(s) after the last one its "
                    "caller saw", self.worker.replica, flag.request_id, free_s, steps)

    def _busy_period(self, run: Callable[[], None]) -> None:
        max_batch = (self.worker.config.batching or BatchingConfig()).max_batch
        self._leased_activation_bytes = self.worker.activation_bytes(self.last_spec, max_batch)
        with self.worker.in_use(self._leased_activation_bytes):
            run()
        self.worker.set_batch(0, self.batcher.batch.mean_batch)

    def _fits(self, batch: list[StepRequest]) -> bool:
        """A request joins only if the batch's predicted activations fit what this busy period
        leased (leased for max_batch of the shape that started it; a larger shape waits)."""
        together = dataclasses.replace(batch[0].spec, n=sum(r.spec.n for r in batch), text_tokens=_longest_text(batch))
        need = self.worker.activation_bytes(together)
        if need > self._leased_activation_bytes:
            logger.info("%s: request %s waits: a batch of %d needs %d B of activations > %d B leased",
                        self.worker.replica, batch[-1].spec.request_id, len(batch), need,
                        self._leased_activation_bytes)
            return False
        return self._adapters_fit(batch)

    def _adapters_fit(self, batch: list[StepRequest]) -> bool:
        """A request joins only if every adapter the batch would use fits the adapters' device budget at
        once (a forward needs all its adapters on the device); otherwise it waits for others to leave."""
        names = {r.spec.lora for r in batch if r.spec.lora is not None}
        if not names or getattr(self.worker, "loras", None) is None or self.worker.adapters_fit(names):
            return True
        logger.info("%s: request %s waits: adapters %s together exceed the %d B adapter budget",
                    self.worker.replica, batch[-1].spec.request_id, sorted(names),
                    self.worker.config.lora_device_budget)
        return False

    def _on_forward(self, figures: ForwardFigures) -> None:
        self.load.on_forward(figures)
        self.batch_metrics.record_forward(figures)
        self.worker.set_batch(figures.requests, self.batcher.batch.mean_batch)

    def residency(self) -> ReplicaResidency:
        return self.worker.report()

    def record_routing_stats(self) -> dict[str, float]:
        """Serve's controller polls this every request_routing_stats_period_s for the request router:
        GPU type, plan, queue, measured seconds per step (deployments.capacity.replica_load)."""
        load = self.load.snapshot()
        self.work_gauges.record(load.running_batch + len(load.waiting), work_seconds(load))
        return load.to_stats()

    def record_autoscaling_stats(self) -> dict[str, float]:
        """Serve's replica calls this every autoscaling metrics_interval_s for the work policy
        (deployments.capacity.work_autoscaling): the work it holds at its own measured step times."""
        stats = autoscaling_stats(self.load.snapshot(), self._request_s)
        self._request_s = stats.get(REQUEST_S, self._request_s)
        self.work_gauges.record(int(stats[REQUESTS]), stats.get(WORK_S))
        return stats

    def __del__(self):  # Serve calls it on graceful replica shutdown
        if hasattr(self, "batcher"):
            self.batcher.close()
        if hasattr(self, "worker"):
            self.worker.close()


def _longest_text(batch: list[StepRequest]) -> int | None:
    """The batch's text tokens per row: its forward pads every prompt to the longest (None: padded prompts)."""
    counts = [r.spec.text_tokens for r in batch if r.spec.text_tokens is not None]
    return max(counts) if counts else None


def finite_frames(frames: torch.Tensor, dtype: str) -> torch.Tensor:
    """``frames``, or :class:`NonFiniteOutput` counting the NaN and infinite values: a NaN casts to pixel 0,
    so the client would get a black image with a 200. The frames' sum is finite exactly when every value
    is (they are in [0, 1]: no sum of them overflows float32): one pass, no copy. On a 1280x720x81 video
    (224 M values, one thread) the sum takes 0.08 s; ``isfinite(...).sum()`` took 3.9 s, so it counts
    only a failure."""
    if math.isfinite(float(frames.sum())):
        return frames
    bad = frames.numel() - int(torch.isfinite(frames).sum())
    fix = " (float16 overflows where bfloat16 does not: serve with dtype bfloat16)" if dtype == "float16" else ""
    raise NonFiniteOutput(f"the decoder made {bad} of {frames.numel()} output values NaN or infinite in {dtype}{fix}")


@serve.deployment(name="VaeDecoder")
class VaeDecoder:
    def __init__(self, config: StageConfig):
        into_replica_log()
        self.worker = StageWorker(config)
        self.thread = StageThread(config.stage.value)

    async def decode(self, latents: StageOutput, spec: GenerationSpec) -> StageOutput:
        worker = self.worker
        decoded = await self.thread.call(worker.run, lambda: finite_frames(families.decode(
            worker.pipe, worker.config.facts, latents.value, spec, worker.device), worker.config.dtype), spec)
        return decoded.after(latents)

    async def condition(self, spec: GenerationSpec) -> StageOutput:
        """Image-to-video: the reference image's conditioning, on this replica's VAE (no other stage
        loads it), for the Denoiser."""
        worker = self.worker
        return await self.thread.call(worker.run, lambda: families.condition(
            worker.pipe, worker.config.facts, spec, worker.device), families.condition_shape(worker.config.facts, spec))

    def residency(self) -> ReplicaResidency:
        return self.worker.report()

    def __del__(self):  # Serve calls it on graceful replica shutdown
        if hasattr(self, "thread"):
            self.thread.close()
        if hasattr(self, "worker"):
            self.worker.close()
