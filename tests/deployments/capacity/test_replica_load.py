"""ReplicaLoad's routing-stats encoding and the finish model both router and autoscaler use."""
import pytest

from deployments.capacity.finish_model import (
    DEFAULT_JOIN_COST,
    join_cost,
    predicted_finish_s,
    step_seconds,
    with_peer_timings,
    work_seconds,
)
from deployments.capacity.replica_load import PlanSummary, QueuedWork, ReplicaLoad, Shape, StatsError, StepTiming

IMAGE = Shape(512, 512, 1)
VIDEO = Shape(512, 512, 9)
PLAN = PlanSummary("balanced", 10, 30, 0.5)


def load(step_s=(), running=(), waiting=(), max_batch=4, gpu="L4") -> ReplicaLoad:
    return ReplicaLoad(gpu, PLAN, max_batch, tuple(running), tuple(waiting), tuple(step_s), 100.0)


def test_stats_round_trip_is_a_flat_float_dict():
    original = load([StepTiming(IMAGE, 1, 0.1, 7), StepTiming(IMAGE, 2, 0.12, 3)],
                    [QueuedWork(IMAGE, 3), QueuedWork(IMAGE, 20)], [QueuedWork(VIDEO, 30), QueuedWork(IMAGE, 4)])
    stats = original.to_stats()
    assert all(isinstance(k, str) and isinstance(v, float) for k, v in stats.items())
    assert ReplicaLoad.from_stats(stats) == original


@pytest.mark.parametrize("stats", [{}, {"v": 99.0}, {**load().to_stats(), "run|x|512x512x1n1": 3.0},
                                   {**load().to_stats(), "gpu|H100": 1.0}])
def test_unreadable_stats_raise_a_typed_error(stats):
    with pytest.raises(StatsError):
        ReplicaLoad.from_stats(stats)


def test_shape_key_round_trips_and_refuses_garbage():
    assert Shape.from_key(VIDEO.key) == VIDEO
    with pytest.raises(StatsError):
        Shape.from_key("512x512")


def test_join_cost_is_fitted_from_two_measured_batch_sizes():
    # t(1) = 1.0, t(3) = 1.6: each extra request adds 0.3 of a step.
    fitted = load([StepTiming(IMAGE, 1, 1.0, 5), StepTiming(IMAGE, 3, 1.6, 5)])
    assert join_cost(fitted, IMAGE) == pytest.approx(0.3)
    assert step_seconds(fitted, IMAGE, 2) == pytest.approx(1.3)
    assert join_cost(load([StepTiming(IMAGE, 1, 1.0, 5)]), IMAGE) == DEFAULT_JOIN_COST


def test_an_unmeasured_shape_is_priced_by_its_pixel_frames():
    measured = load([StepTiming(IMAGE, 1, 0.1, 5)])
    assert step_seconds(measured, VIDEO, 1) == pytest.approx(0.9)
    assert step_seconds(load(), IMAGE, 1) is None


def test_work_seconds_replays_the_batch_draining():
    # Batch of 2 (t(2) = 1.25 s with the default join cost): 2 steps together, then 3 alone (1 s).
    busy = load([StepTiming(IMAGE, 1, 1.0, 5)], running=[QueuedWork(IMAGE, 2), QueuedWork(IMAGE, 5)])
    assert work_seconds(busy) == pytest.approx(2 * 1.25 + 3 * 1.0)
    assert work_seconds(load([StepTiming(IMAGE, 1, 1.0, 5)])) == 0.0
    assert work_seconds(load(running=[QueuedWork(IMAGE, 2)])) is None


def test_an_incompatible_request_waits_for_the_batch_to_drain():
    busy = load([StepTiming(IMAGE, 1, 1.0, 5), StepTiming(VIDEO, 1, 2.0, 5)], running=[QueuedWork(IMAGE, 4)])
    prediction = predicted_finish_s(busy, VIDEO, 3)
    assert not prediction.joins_running
    assert prediction.finish_s == pytest.approx(4 * 1.0 + 3 * 2.0)
    joining = predicted_finish_s(busy, IMAGE, 3)
    assert joining.joins_running and joining.finish_s == pytest.approx(3 * 1.25)


def test_a_new_replica_borrows_step_times_from_a_peer_of_its_type():
    peer = load([StepTiming(IMAGE, 1, 0.5, 9)])
    other = load([StepTiming(IMAGE, 1, 0.1, 9)], gpu="H100")
    borrowed = with_peer_timings(load(), [other, peer])
    assert step_seconds(borrowed, IMAGE, 1) == 0.5


def test_a_request_arriving_after_the_stats_joins_at_the_next_boundary_and_counts_from_now():
    busy = load([StepTiming(IMAGE, 1, 1.0, 5)], running=[QueuedWork(IMAGE, 4)])
    # 0.5 s after the stats: it joins after the first step (1 s), runs 3 steps with it at 1.25 s, then 1
    # more alone: 1 + 3.75 + 1 = 5.75 s from the stats, 5.25 s from now.
    prediction = predicted_finish_s(busy, IMAGE, 4, elapsed_s=0.5)
    assert prediction.joins_running and prediction.finish_s == pytest.approx(5.25)
    # Sent there 0.2 s after the stats (before this one): it takes the boundary first, this one joins too.
    sent = [(0.2, QueuedWork(IMAGE, 4))]
    assert predicted_finish_s(busy, IMAGE, 4, 0.5, sent).finish_s == pytest.approx(1 + 3 * 1.5 + 1.25 - 0.5)
