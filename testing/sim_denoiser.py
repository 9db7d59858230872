"""A stand-in Denoiser whose steps cost simulated time: for routing benches and tests, never the service.

The stand-in batches with the service's own :class:`~deployments.replica.batching.StepBatch` and
:class:`~deployments.replica.batching.StepBatcher`, measures with the Denoiser's
:class:`~deployments.replica.load_tracker.LoadTracker` and answers ``record_routing_stats`` as the
Denoiser does (``self.load.snapshot().to_stats()``); only the forward is simulated: the batch's thread
sleeps for the step's cost (so on a 2-core machine the bench measures routing, not CPU contention).

A step of ``b`` requests at a shape costs ``base_step_s x speed x (pixel_frames / 512^2) ^ shape_exponent
x (1 + join_cost (b - 1))``, times a seeded jitter within +-``jitter`` per step. The replica's GPU type
(and with it ``speed``) comes from the node it landed on: a node's custom resource
``sim_gpu_type:<name>`` names it, as a KubeRay worker group's label would name an L4 or an H100; the
deployment asks only for ``sim_gpu`` (a GPU, not a type).
"""
from __future__ import annotations

import asyncio
import logging
import os
import random
import time
from dataclasses import dataclass, field

import ray
import torch
from ray import serve

from deployments.capacity.replica_load import PlanSummary, Shape
from deployments.models.steppers import BatchKey, StepRequest
from deployments.replica.batching import BatchingConfig, ForwardFigures, StepBatch, StepBatcher
from deployments.replica.load_tracker import LoadTracker

logger = logging.getLogger(__name__)

TYPE_RESOURCE = "sim_gpu_type:"  # a node's resource naming its simulated GPU type
GPU_RESOURCE = "sim_gpu"  # what a stand-in replica asks for
_REFERENCE_PIXEL_FRAMES = 512 * 512


@dataclass(frozen=True)
class SimCost:
    base_step_s: float = 0.01  # one 512x512 image step, batch of 1, on the fastest type
    shape_exponent: float = 1.2  # attention makes a step grow faster than its pixels
    join_cost: float = 0.3  # each extra request in a batch adds this fraction of a step
    jitter: float = 0.2  # +- per step, uniform
    speeds: tuple[tuple[str, float], ...] = (("SIM1X", 1.0), ("SIM3X", 3.0))  # step time factor per type
    seed: int = 0

    def step_s(self, shape: Shape, batch: int, speed: float) -> float:
        size = (shape.pixel_frames / _REFERENCE_PIXEL_FRAMES) ** self.shape_exponent
        return self.base_step_s * speed * size * (1 + self.join_cost * (batch - 1))


@dataclass
class _Scheduler:
    def step(self, noise, t, latents, return_dict=False):
        return (latents,)


@dataclass
class SimStepper:
    """The Stepper protocol over simulated time (``forward`` sleeps in the batch's thread)."""

    cost: SimCost
    speed: float
    rng: random.Random = field(default_factory=random.Random)

    def start(self, encoded, spec, on_step=None) -> StepRequest:
        shape = Shape.of(spec)
        key = BatchKey((shape.width, shape.height, shape.frames), torch.float32, 0, False)
        return StepRequest(spec, key, _Scheduler(), torch.arange(spec.steps), torch.zeros(spec.n, 1), {}, None,
                           on_step)

    def forward(self, batch: list[StepRequest]) -> list[torch.Tensor]:
        base = self.cost.step_s(Shape.of(batch[0].spec), len(batch), self.speed)
        time.sleep(base * self.rng.uniform(1 - self.cost.jitter, 1 + self.cost.jitter))
        return [torch.zeros_like(r.latents) for r in batch]


def node_gpu_type(default: str) -> str:
    """The simulated GPU type of the node this process runs on (its ``sim_gpu_type:<name>`` resource)."""
    node_id = ray.get_runtime_context().get_node_id()
    for node in ray.nodes():
        if node["NodeID"] == node_id:
            types = [r[len(TYPE_RESOURCE):] for r in node["Resources"] if r.startswith(TYPE_RESOURCE)]
            if types:
                return types[0]
    return default


@dataclass(frozen=True)
class SimFaults:
    """Faults for the tests: replicas of ``hang_stats_type`` do not answer stats polls while the file
    ``hang_stats_file`` exists (they still serve requests), as a replica wedged for the controller."""

    hang_stats_type: str | None = None
    hang_stats_file: str | None = None


@dataclass(frozen=True)
class SimResult:
    request_id: str
    replica: str
    gpu_type: str
    seconds: float  # from submission to the batch to the last step


@serve.deployment(name="Denoiser")
class SimDenoiser:
    """Same batching, same load tracking, same routing stats as the Denoiser; simulated forwards."""

    def __init__(self, cost: SimCost, batching: BatchingConfig = BatchingConfig(gather_s=0.0),
                 faults: SimFaults = SimFaults()):
        speeds = dict(cost.speeds)
        self.gpu_type = node_gpu_type(cost.speeds[0][0])
        self.replica = serve.get_replica_context().replica_id.to_full_id_str()
        self.stepper = SimStepper(cost, speeds[self.gpu_type], random.Random(f"{cost.seed}/{self.replica}"))
        batch = StepBatch(self.stepper, batching, on_forward=self._on_forward)
        self.load = LoadTracker(batch, self.gpu_type, lambda: PlanSummary("simulated", 0, 0, 0.0))
        self.batcher = StepBatcher(batch)
        self.faults = faults
        logger.info("stand-in Denoiser %s: %s, step time x%g", self.replica, self.gpu_type, speeds[self.gpu_type])

    def _on_forward(self, figures: ForwardFigures) -> None:
        self.load.on_forward(figures)

    async def denoise(self, encoded, spec, progress: bool = False, condition=None) -> SimResult:
        start = time.perf_counter()
        await asyncio.wrap_future(self.batcher.submit(self.stepper.start(encoded, spec)))
        return SimResult(spec.request_id, self.replica, self.gpu_type, time.perf_counter() - start)

    async def record_routing_stats(self) -> dict[str, float]:
        """The Denoiser's stats; no answer while its :class:`SimFaults` hang is on."""
        if self.faults.hang_stats_type == self.gpu_type and self.faults.hang_stats_file:
            while os.path.exists(self.faults.hang_stats_file):
                await asyncio.sleep(0.05)
        return self.load.snapshot().to_stats()

    def identity(self) -> tuple[str, str]:
        return self.replica, self.gpu_type

    def __del__(self):
        if hasattr(self, "batcher"):
            self.batcher.close()
