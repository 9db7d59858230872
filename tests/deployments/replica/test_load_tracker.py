"""The Denoiser's routing stats: step times per (shape, batch) measured off its batch, its queue, its plan."""
from __future__ import annotations

import pytest
import torch

from deployments.app import stage_configs
from deployments.capacity.replica_load import PlanSummary, ReplicaLoad, Shape
from deployments.models import families
from deployments.replica.batching import BatchingConfig, StepBatch
from deployments.replica.load_tracker import EWMA_WEIGHT, LoadTracker, tracker_for
from deployments.wire.spec import GenerationSpec, PipelineStage
from testing.sim_denoiser import SimCost, SimStepper
from tests.deployments.conftest import tiny_args
from zoo.tiny import ensure_tiny_wan

IMAGE, VIDEO = Shape(64, 64, 1), Shape(64, 64, 5)


class ClockedStepper(SimStepper):
    """Each forward advances a fake clock by ``costs[(shape, batch)]``: the figures the batch reports."""

    def __init__(self, clock: list[float], costs: dict):
        super().__init__(SimCost(), 1.0)
        self.clock, self.costs = clock, costs

    during_forward = staticmethod(lambda: None)

    def forward(self, batch):
        self.during_forward()
        self.clock[0] += self.costs[(Shape.of(batch[0].spec), len(batch))].pop(0)
        return [torch.zeros_like(r.latents) for r in batch]


def spec(request_id: str, shape: Shape, steps: int) -> GenerationSpec:
    return GenerationSpec(request_id, "p", None, shape.height, shape.width, shape.frames, steps, 5.0, 0, shape.n)


def batch_with(costs: dict, tracker_clock=lambda: 50.0) -> tuple[StepBatch, LoadTracker, ClockedStepper]:
    clock = [0.0]
    stepper = ClockedStepper(clock, costs)
    tracker: LoadTracker | None = None
    batch = StepBatch(stepper, BatchingConfig(max_batch=2), clock=lambda: clock[0],
                      on_forward=lambda figures: tracker.on_forward(figures))
    tracker = LoadTracker(batch, "L4", lambda: PlanSummary("speed", 4, 0, 0.0), clock=tracker_clock)
    return batch, tracker, stepper


def test_step_times_are_measured_per_shape_and_batch_size():
    batch, tracker, stepper = batch_with({(IMAGE, 2): [0.2, 0.2], (IMAGE, 1): [0.1], (VIDEO, 1): [0.5]})
    for request in (spec("a", IMAGE, 2), spec("b", IMAGE, 3), spec("c", VIDEO, 1)):
        batch.submit(stepper.start(None, request))
    while not batch.idle:
        batch.step()
    timings = {(t.shape, t.batch): (t.seconds, t.forwards) for t in tracker.snapshot().step_s}
    assert timings == {(IMAGE, 2): (pytest.approx(0.2), 2), (IMAGE, 1): (pytest.approx(0.1), 1),
                       (VIDEO, 1): (pytest.approx(0.5), 1)}


def test_the_average_follows_a_replica_that_slowed():
    many = 3 * int(1 / EWMA_WEIGHT)
    batch, tracker, stepper = batch_with({(IMAGE, 1): [0.1] * many + [0.3] * many})
    batch.submit(stepper.start(None, spec("a", IMAGE, 2 * many)))
    while not batch.idle:
        batch.step()
    (timing,) = tracker.snapshot().step_s
    assert timing.seconds == pytest.approx(0.3, rel=0.05)  # the last 30 forwards, not the mean 0.2


def test_the_snapshot_has_the_running_batch_and_the_queue_with_their_steps_left():
    batch, tracker, stepper = batch_with({(IMAGE, 2): [0.2], (IMAGE, 1): [0.1] * 9})
    for request in (spec("a", IMAGE, 4), spec("b", IMAGE, 6), spec("c", IMAGE, 5)):
        batch.submit(stepper.start(None, request))
    batch.step()
    load = ReplicaLoad.from_stats(tracker.snapshot().to_stats())
    assert [w.steps for w in load.running] == [3, 5] and [w.steps for w in load.waiting] == [5]
    assert (load.gpu_type, load.max_batch, load.at_s) == ("L4", 2, 50.0)


def test_progress_is_dated_by_the_last_forward_or_the_first_snapshot_that_saw_the_batch_running():
    now, seen = [10.0], []
    batch, tracker, stepper = batch_with({(IMAGE, 1): [0.1] * 5}, tracker_clock=lambda: now[0])
    assert tracker.snapshot().progress_at_s is None  # idle
    # The first forward of a batch started from idle: no forward dates it yet, the snapshot does.
    stepper.during_forward = lambda: seen.append(tracker.snapshot().progress_at_s)
    batch.submit(stepper.start(None, spec("a", IMAGE, 4)))
    batch.step()
    assert seen == [10.0]
    stepper.during_forward = lambda: None
    now[0] = 25.0  # a thread hung after the forward that ended at 10.0: 15 s without progress
    assert ReplicaLoad.from_stats(tracker.snapshot().to_stats()).progress_at_s == 10.0
    assert tracker.snapshot().stalled_s() == 15.0  # what the router's stuck rule reads
    batch.step()
    assert tracker.snapshot().progress_at_s == 25.0 and tracker.snapshot().stalled_s() == 0.0
    while not batch.idle:
        batch.step()
    now[0] = 100.0
    assert tracker.snapshot().progress_at_s is None and tracker.snapshot().stalled_s() == 0.0


def test_a_tiny_wan_denoiser_reports_its_type_and_plan(workers):
    facts = families.read_family_traits(ensure_tiny_wan())
    worker = workers(stage_configs(tiny_args(), facts)[PipelineStage.DENOISE])
    tracker = tracker_for(StepBatch(None), worker)
    load = tracker.snapshot()
    assert load.gpu_type == "CPU"  # no GPU here; on one, its fleet profile's type ("L4", "H100")
    # tiny_args streams every layer of the denoiser (memory mode): none resident, all pinned-planned.
    assert load.plan.mode == "memory" and load.plan.resident_layers == 0 and load.plan.streamed_layers > 0


def test_the_denoiser_answers_serves_stats_poll_with_the_steps_it_ran(workers):
    """The deployment's own record_routing_stats, on the tiny Wan outside Serve: one request run, its
    shape's step time measured, nothing left queued."""
    import asyncio

    from deployments.replica.stages import Denoiser, encode_on

    configs = stage_configs(tiny_args(), families.read_family_traits(ensure_tiny_wan()))
    request = spec("r", Shape(16, 16, 1), 3)
    encoded = encode_on(workers(configs[PipelineStage.ENCODE]), request)
    denoiser = Denoiser.func_or_class(configs[PipelineStage.DENOISE])
    try:
        async def run():
            return [item async for item in denoiser.denoise(encoded, request, progress=False)]

        asyncio.run(run())
        load = ReplicaLoad.from_stats(denoiser.record_routing_stats())
    finally:
        denoiser.batcher.close()
        denoiser.worker.close()
    assert [(t.shape, t.batch, t.forwards) for t in load.step_s] == [(Shape(16, 16, 1), 1, 3)]
    assert load.running == () and load.waiting == () and load.gpu_type == "CPU"
    assert load.plan.mode == "memory" and load.plan.streamed_layers > 0
