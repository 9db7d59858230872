"""A batching stage replica's load for the request router: measured step times and a snapshot of its queue.

Runs in the Denoiser replica's process (and in the mixed-fleet bench's stand-in replicas, which
batch with the same :class:`~deployments.replica.batching.StepBatch`): the batch's thread calls
:meth:`LoadTracker.on_forward` after every forward; Serve's controller calls the deployment's
``record_routing_stats`` every ``request_routing_stats_period_s``, which returns
``tracker.snapshot().to_stats()`` (:class:`deployments.capacity.replica_load.ReplicaLoad`).
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Callable

from deployments.capacity.replica_load import PlanSummary, QueuedWork, ReplicaLoad, Shape, StepTiming
from deployments.replica.batching import ForwardFigures, StepBatch

logger = logging.getLogger(__name__)

# Step times are a moving average with this weight on the newest forward, after a plain mean of the
# first 1/EWMA_WEIGHT forwards: +-20 % jitter per step (the mixed-fleet bench's) averages to within
# ~4 % over 10 forwards, and a replica that slows (a neighbour's lease, a re-plan) shows it within ~10.
EWMA_WEIGHT = 0.1


def gpu_type_of(memory) -> str:
    """A replica's GPU type as the fleet names it: its profile's accelerator type, else the GPU's
    name, else "CPU" (``memory``: its :class:`cluster.replica.ledger_view.ReplicaMemory`)."""
    if memory.gpu is None:
        return "CPU"
    return memory.profile.accelerator_type or memory.gpu.name


def plan_summary(plan, mode: str) -> PlanSummary:
    """Resident and streamed layer counts and the pinned share of an offload_core PipelinePlan."""
    from offload_core.host.tier import HostingTier
    from offload_core.planner.strategy import Strategy

    resident = streamed = pinned = 0
    layers = {} if plan.facts is None else {c.name: len(c.layers) for c in plan.facts.components}
    for component in plan.components:
        if component.strategy is Strategy.RESIDENT:
            resident += layers.get(component.name, 0)
        elif component.strategy is Strategy.LAYERWISE:
            resident += component.resident_layers
            moving = component.hosting[component.resident_layers:]
            streamed += len(moving)
            pinned += sum(1 for _, tier in moving if tier is HostingTier.PINNED)
        else:  # MODEL_OFFLOAD: every layer comes in once per use
            streamed += layers.get(component.name, 0)
    return PlanSummary(mode, resident, streamed, pinned / streamed if streamed else 0.0)


class LoadTracker:
    """Seconds per step per (shape, batch size), measured from the batch's forwards; the queue read off the batch."""

    def __init__(self, batch: StepBatch, gpu_type: str, plan: Callable[[], PlanSummary],
                 clock: Callable[[], float] = time.time):
        self.batch, self.gpu_type, self._plan, self._clock = batch, gpu_type, plan, clock
        self._lock = threading.Lock()  # the batch's thread writes timings; Serve's loop reads them
        self._timings: dict[tuple[Shape, int], StepTiming] = {}
        # When the running batch last made progress: its last forward's end, or the first snapshot that
        # saw it running after an idle one (a batch starting from idle has no forward yet to date it).
        self._progress_at: float | None = None

    def on_forward(self, figures: ForwardFigures) -> None:
        """After each forward (the batch's thread, before done requests leave: ``running`` is the batch
        that ran)."""
        running = list(self.batch.running)
        if not running or figures.requests != len(running):
            return
        shape = Shape.of(running[0].request.spec)
        key = (shape, figures.requests)
        with self._lock:
            self._progress_at = self._clock()
            old = self._timings.get(key)
            if old is None:
                self._timings[key] = StepTiming(shape, figures.requests, figures.seconds, 1)
                return
            weight = max(EWMA_WEIGHT, 1.0 / (old.forwards + 1))
            seconds = old.seconds + weight * (figures.seconds - old.seconds)
            self._timings[key] = StepTiming(shape, figures.requests, seconds, old.forwards + 1)

    def snapshot(self) -> ReplicaLoad:
        """The replica's load now. The lists are copied first (one C-level copy each, atomic under the
        GIL): the batch's thread moves requests between them at step boundaries."""
        running, waiting = list(self.batch.running), list(self.batch.waiting)
        now = self._clock()
        with self._lock:
            timings = tuple(self._timings.values())
            if not running:
                self._progress_at = None
            elif self._progress_at is None:
                self._progress_at = now
            progress = self._progress_at
        return ReplicaLoad(self.gpu_type, self._plan(), self.batch.config.max_batch,
                           tuple(_work(e.request) for e in running), tuple(_work(e.request) for e in waiting),
                           timings, now, progress)


def _work(request) -> QueuedWork:
    return QueuedWork(Shape.of(request.spec), max(0, len(request.timesteps) - request.step))


def tracker_for(batch: StepBatch, worker) -> LoadTracker:
    """The Denoiser's tracker: GPU type and plan from its worker (a tensor-parallel replica's ranks
    hold the plan and the GPUs: it reports ``tp<N>`` and an empty plan; /v1/residency has the ranks')."""
    memory, residency = getattr(worker, "memory", None), worker.residency
    if memory is None or not hasattr(residency, "plan"):
        ranks = PlanSummary("ranks", 0, 0, 0.0)
        return LoadTracker(batch, f"tp{worker.config.tp_size}", lambda: ranks)
    return LoadTracker(batch, gpu_type_of(memory),
                       lambda: plan_summary(worker.residency.plan, worker.residency.mode.value))
