"""A tensor-parallel Denoiser replica: its transformer is a proxy whose forward runs on every rank.

Runs in two kinds of process: the Denoiser replica (:class:`TransformerProxy` in place of the
pipeline's transformer, and :class:`RankedStageWorker` in place of its :class:`StageWorker`) and
each rank actor of its :class:`~deployments.replica.tensor_parallel.group.ShardGroup` (:func:`forward_on`, on the
rank's own StageWorker, which loaded only its slice of the DiT).

The replica keeps everything but the transformer's forward: the scheduler, the step batcher, each
request's latents, cancellation. One step of a batch is one fan-out (the group's lock keeps every
rank's collectives in one order), and rank 0's output is the noise. Each rank leases the busy
period's activations around each forward it runs (at tp_size 1 the replica leases once per busy
period); the step cache is refused (its per-block hooks would have to run on the ranks).
"""
from __future__ import annotations

import contextlib
import logging
from typing import Any, Callable, Protocol

import torch

from compat.torch import tree_map
from deployments.capacity.replica_report import ReplicaResidency
from deployments.models import families
from deployments.replica.metrics import StageMetrics
from deployments.replica.worker import DTYPES, StageConfig, StageWorker
from deployments.wire.spec import GenerationSpec, PipelineStage, RequestRejected, StageStats

logger = logging.getLogger(__name__)


class RankGroup(Protocol):
    """The replica's ranks (``ShardGroup``): ``fn(rank_worker, *args)`` on every rank in one order, rank 0's result."""

    def call(self, fn: Callable, *args) -> Any: ...

    def reports(self) -> list[ReplicaResidency]: ...


class StepCacheAtTensorParallel(ValueError):
    """A default ``cache_threshold`` > 0 for a Denoiser at ``tp_size`` > 1 (the step cache runs in one process)."""


def refuse_step_cache(config: StageConfig) -> None:
    """The step cache hooks the transformer's blocks, which live on the ranks: refused at tp_size > 1."""
    if config.tp_size > 1 and config.cache_threshold > 0:
        raise StepCacheAtTensorParallel(
            f"cache_threshold {config.cache_threshold} for the denoise stage at tp_size {config.tp_size}: the step "
            "cache hooks the transformer's blocks in one process; set it to 0 or run the Denoiser at tp_size 1")


def refuse_cached_request(config: StageConfig, spec: GenerationSpec) -> None:
    """A request asking for the step cache from a Denoiser at tp_size > 1: 4xx naming the field."""
    if config.tp_size > 1 and (spec.cache_threshold or 0) > 0:
        raise RequestRejected("cache_threshold", (
            f"cache_threshold {spec.cache_threshold}: this deployment's denoise stage runs over {config.tp_size} "
            "tensor-parallel ranks, where the step cache does not run; omit it or set it to 0"))


def _to(device: torch.device):
    return lambda x: x.to(device) if isinstance(x, torch.Tensor) else x


def forward_on(worker: StageWorker, args: tuple, kwargs: dict, activation_bytes: int) -> tuple[Any, int, int]:
    """One transformer forward on a rank (every rank runs it; its collectives meet the others'): its
    output on the CPU, and the weight bytes the rank moved to its device for it and its device peak
    (the forward is one use of the rank's stage)."""
    args, kwargs = tree_map(_to(worker.device), (args, kwargs))
    with torch.no_grad(), worker.in_use(activation_bytes):
        out = worker.pipe.transformer(*args, **kwargs)
    return tree_map(_to(families.CPU), out), worker.residency.bytes_streamed(), worker.residency.device_peak_bytes()


def _admit_on(worker: StageWorker, spec: GenerationSpec) -> None:
    worker.admit(spec)


def _activation_bytes_on(worker: StageWorker, spec: GenerationSpec | None, batch: int) -> int:
    return worker.activation_bytes(spec, batch)


class TransformerProxy:
    """Stands in for the pipeline's transformer in the replica: its config and dtype (from a weightless
    copy on the meta device), and a forward that is the group's call."""

    def __init__(self, group: RankGroup, model_on_meta: torch.nn.Module, dtype: torch.dtype, device: torch.device):
        self.group, self.config, self.dtype, self.device = group, model_on_meta.config, dtype, device
        self.activation_bytes = 0  # what each rank leases around a forward (the busy period's)
        self.streamed = 0  # rank 0's weight bytes moved to its device, all forwards so far (a counter)
        self.peak = 0  # rank 0's device peak in its last forward

    def __call__(self, *args, **kwargs):
        out, streamed, self.peak = self.group.call(forward_on, args, kwargs, self.activation_bytes)
        self.streamed += streamed
        return tree_map(_to(self.device), out)


class RankedStageWorker:
    """What the Denoiser replica asks of its worker, at tp_size > 1: the ranks hold the weights, plan,
    lease and report (rank 0's report is the replica's); admission and activation sizes are rank 0's."""

    def __init__(self, config: StageConfig, group: RankGroup, replica: str, close: Callable[[], None] = lambda: None):
        assert config.stage is PipelineStage.DENOISE, config.stage
        refuse_step_cache(config)
        self.config, self.group, self.replica, self._close = config, group, replica, close
        self.device = families.CPU  # the replica holds latents and schedulers; each rank moves a step's inputs
        dtype = DTYPES[config.dtype]
        self.pipe = families.load_stage_pipeline(config.facts, config.stage, dtype, {"transformer": None})
        self.pipe.transformer = TransformerProxy(group, _on_meta(config.facts.folder, dtype), dtype, self.device)
        self.metrics = StageMetrics(config.stage.value)
        self.residency = self  # bytes_streamed_so_far / device_peak_bytes: rank 0's, from its forwards
        logger.info("%s: denoise stage over %d ranks: the transformer's forward fans out to them, the scheduler "
                    "and the step batcher stay here", replica, config.tp_size)

    @property
    def proxy(self) -> TransformerProxy:
        return self.pipe.transformer

    def bytes_streamed_so_far(self) -> int:
        return self.proxy.streamed

    def device_peak_bytes(self) -> int:
        return self.proxy.peak

    def admit(self, spec: GenerationSpec) -> None:
        self.group.call(_admit_on, spec)

    def activation_bytes(self, spec: GenerationSpec | None, batch: int = 1) -> int:
        return self.group.call(_activation_bytes_on, spec, batch)

    @contextlib.contextmanager
    def in_use(self, activation_bytes: int = 0):
        """The busy period: each rank leases ``activation_bytes`` around each forward of it."""
        self.proxy.activation_bytes = activation_bytes
        try:
            yield
        finally:
            self.proxy.activation_bytes = 0

    def set_batch(self, size: int, mean: float) -> None:
        """The ranks' reports carry no batch size (the batch lives here); the replica's metrics do."""

    def record(self, stats: StageStats) -> None:
        self.metrics.record(stats)

    def report(self) -> ReplicaResidency:
        return self.group.reports()[0]

    def close(self) -> None:
        self._close()


def _on_meta(folder: str, dtype: torch.dtype) -> torch.nn.Module:
    """The folder's transformer without weights (its config and class: what a stepper reads of it)."""
    import json
    import pathlib

    import diffusers

    cls = getattr(diffusers, json.loads((pathlib.Path(folder) / "model_index.json").read_text())["transformer"][1])
    with torch.device("meta"):
        return cls.from_config(cls.load_config(folder, subfolder="transformer")).to(dtype)
