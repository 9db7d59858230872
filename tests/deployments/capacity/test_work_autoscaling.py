"""The autoscaling policy on work: each decision rule on a constructed Serve AutoscalingContext, in process."""
from __future__ import annotations

import logging
from dataclasses import dataclass

import pytest
from ray.serve.config import AutoscalingConfig, AutoscalingContext

from deployments.capacity import work_autoscaling as work
from deployments.capacity.replica_load import PlanSummary, QueuedWork, ReplicaLoad, Shape, StepTiming
from deployments.capacity.work_autoscaling import (
    POLICY_PATH,
    REQUEST_S,
    REQUESTS,
    WORK_S,
    Basis,
    WorkPolicy,
    autoscaling_stats,
)

IMAGE = Shape(512, 512, 1)
NOW = 1000.0
METRICS_INTERVAL_S = 2.0  # stale after max(3 intervals, 10 s): 10 s


@dataclass(frozen=True)
class Point:
    """One point of a Serve metric series, as the policy reads it (timestamp, value)."""

    timestamp: float
    value: float


def replica_load(step_s: float, queued: int, steps: int = 28, gpu: str = "L4") -> ReplicaLoad:
    """A replica running ``queued`` requests of ``steps`` each, measured at ``step_s`` a step for its batch."""
    timings = (StepTiming(IMAGE, 1, step_s, 9),) + ((StepTiming(IMAGE, queued, step_s, 9),) if queued > 1 else ())
    return ReplicaLoad(gpu, PlanSummary("balanced", 10, 30, 0.5), 4, tuple(QueuedWork(IMAGE, steps)
                                                                           for _ in range(queued)), (), timings, NOW)


def context(replicas: dict[str, dict[str, float]], *, total_requests: float | None = None,
            seen: dict[str, float] | None = None, min_replicas: int = 1, max_replicas: int = 10,
            state: dict | None = None, metrics_interval_s: float = METRICS_INTERVAL_S,
            target_ongoing_requests: float = 2, now: float = NOW) -> AutoscalingContext:
    """Serve's context for a tick at ``now``: ``replicas`` id -> its stats; ``seen`` id -> when its stats
    were last recorded (default NOW); total requests default to those the replicas hold."""
    config = AutoscalingConfig(min_replicas=min_replicas, max_replicas=max_replicas,
                               target_ongoing_requests=target_ongoing_requests, metrics_interval_s=metrics_interval_s)
    seen = seen or {}
    aggregated, raw = {}, {}
    for replica, stats in replicas.items():
        for key, value in stats.items():
            aggregated.setdefault(key, {})[replica] = value
            raw.setdefault(key, {})[replica] = [Point(seen.get(replica, NOW) - 1.0, value),
                                                Point(seen.get(replica, NOW), value)]
    if total_requests is None:
        total_requests = sum(s.get(REQUESTS, 0.0) for s in replicas.values())
    return AutoscalingContext(
        deployment_id=None, deployment_name="Denoiser", app_name="app", current_num_replicas=len(replicas),
        target_num_replicas=len(replicas), running_replicas=list(replicas), total_num_requests=total_requests,
        total_queued_requests=0.0, aggregated_metrics=aggregated, raw_metrics=raw,
        capacity_adjusted_min_replicas=min_replicas, capacity_adjusted_max_replicas=max_replicas,
        policy_state=dict(state or {}), last_scale_up_time=None, last_scale_down_time=None, current_time=now,
        config=config)


def replicas_for(ctx: AutoscalingContext, target_work_s: float = 10.0) -> int:
    replicas, _ = WorkPolicy(target_work_s)(ctx)
    return replicas


def test_a_slow_replicas_queue_counts_more_than_the_same_queue_on_a_fast_one():
    # Two requests of 28 steps each: 2.8 s of work at 0.1 s a step, 8.4 s at 0.3 s (a 3x slower card).
    fast, slow, idle = (autoscaling_stats(replica_load(0.1, 2)), autoscaling_stats(replica_load(0.3, 2)),
                        autoscaling_stats(replica_load(0.1, 0)))
    assert fast[REQUESTS] == slow[REQUESTS] == 2 and slow[WORK_S] == pytest.approx(3 * fast[WORK_S])
    on_fast = context({"a": fast, "b": idle})
    on_slow = context({"a": slow, "b": idle})
    assert on_fast.total_num_requests == on_slow.total_num_requests  # Serve's rule sees the same load
    assert replicas_for(on_fast, target_work_s=5.0) == 1
    assert replicas_for(on_slow, target_work_s=5.0) == 2


def test_the_target_is_work_seconds_per_replica():
    fleet = {"a": {WORK_S: 60.0, REQUESTS: 4.0}, "b": {WORK_S: 40.0, REQUESTS: 4.0}}
    assert replicas_for(context(fleet), target_work_s=30.0) == 4  # 100 s / 30 s, rounded up
    assert replicas_for(context(fleet), target_work_s=50.0) == 2
    assert replicas_for(context(fleet), target_work_s=100.0) == 1


def test_the_count_is_clamped_to_the_deployments_min_and_max():
    busy = {"a": {WORK_S: 1000.0, REQUESTS: 4.0}}
    assert replicas_for(context(busy, max_replicas=3)) == 3
    idle = {"a": {WORK_S: 0.0, REQUESTS: 0.0}, "b": {WORK_S: 0.0, REQUESTS: 0.0}}
    assert replicas_for(context(idle, min_replicas=2)) == 2
    assert replicas_for(context(idle, min_replicas=1)) == 1


def test_requests_queued_at_the_handles_are_priced_at_the_fleets_mean_seconds_per_request():
    # 2 requests on the replica hold 20 s (10 s each); 4 more wait at the handles: 60 s in all.
    fleet = {"a": {WORK_S: 20.0, REQUESTS: 2.0, REQUEST_S: 10.0}}
    assert replicas_for(context(fleet, total_requests=6.0), target_work_s=20.0) == 3
    # Idle replicas price a waiting request at the seconds they reported last (request_s).
    idle = {"a": {WORK_S: 0.0, REQUESTS: 0.0, REQUEST_S: 15.0}}
    assert replicas_for(context(idle, total_requests=4.0), target_work_s=20.0) == 3


def test_a_stale_replicas_requests_are_priced_at_the_fresh_replicas_mean():
    fleet = {"a": {WORK_S: 30.0, REQUESTS: 3.0}, "hung": {WORK_S: 500.0, REQUESTS: 3.0}}
    # The hung replica's 500 s is 12 s old (stale after max(3 x 2 s, 10 s)): its 3 requests count 10 s each.
    stale = context(fleet, seen={"hung": NOW - 12.0})
    assert replicas_for(stale, target_work_s=20.0) == 3  # (30 + 3 x 10) / 20
    assert replicas_for(context(fleet, max_replicas=30), target_work_s=20.0) == 27  # fresh: 530 s / 20
    # A replica that never reported work (no timings yet): the same.
    absent = context({"a": fleet["a"], "new": {REQUESTS: 3.0}})
    assert replicas_for(absent, target_work_s=20.0) == 3


def test_without_any_fresh_stats_the_policy_falls_back_to_serves_ongoing_requests_rule():
    fleet = {"a": {WORK_S: 900.0, REQUESTS: 4.0}, "b": {WORK_S: 900.0, REQUESTS: 4.0}}
    ctx = context(fleet, seen={"a": NOW - 60.0, "b": NOW - 60.0})
    decision = work.decide(work.fleet_work(ctx, 6.0), 10.0)
    assert decision.basis is Basis.NO_STATS and decision.stale == 2
    assert replicas_for(ctx) == 4  # 8 ongoing / target_ongoing_requests 2, not 1800 s / 10 s
    assert replicas_for(context({"a": {}, "b": {}}, total_requests=6.0)) == 3  # nothing reported at all


def test_a_busy_replica_reporting_a_second_apart_at_a_fast_interval_is_not_stale():
    # The CI VM at metrics_interval_s 0.2: Serve delivered a busy replica's points 1.35 s apart, 0.67-1.01 s
    # old at a tick. Stale after 3 intervals (0.6 s), every other tick fell back to ongoing requests (1
    # replica) and the count flapped 1 -> 2 -> 1, stopping each new replica as it started.
    busy = {"a": {WORK_S: 4.0, REQUESTS: 4.0}}
    fast = dict(max_replicas=2, metrics_interval_s=0.2, target_ongoing_requests=100)
    assert replicas_for(context(busy, seen={"a": NOW - 1.0}, **fast), target_work_s=1.0) == 2
    hung = context(busy, seen={"a": NOW - 11.0}, **fast)
    assert replicas_for(hung, target_work_s=1.0) == 1  # Serve's rule: 4 ongoing / 100


def test_a_replica_whose_series_emptied_between_two_reports_counts_its_last_report():
    # Serve keeps a series over look_back_period_s only: with reports further apart, a replica has none
    # at some ticks, while its last report is still fresh.
    policy = WorkPolicy(1.0)
    reported = context({"a": {WORK_S: 4.0, REQUESTS: 4.0}}, seen={"a": NOW - 0.5}, max_replicas=4)
    replicas, state = policy(reported)
    assert replicas == 4
    emptied = context({"a": {}}, total_requests=4.0, max_replicas=4, state=state)
    again, state = policy(emptied)
    assert again == 4, "the replica's 4 s of work, not Serve's 4 ongoing / 2 = 2"
    later = context({"a": {}}, total_requests=4.0, max_replicas=4, state=state, now=NOW + 10.0)
    assert policy(later)[0] == 2, "11.5 s after its last report it is stale: Serve's rule"


def test_the_decision_is_logged_once_per_change_with_its_numbers(caplog):
    policy = WorkPolicy(10.0)
    fleet = {"a": {WORK_S: 25.0, REQUESTS: 2.0}}
    with caplog.at_level(logging.INFO, logger=work.logger.name):
        replicas, state = policy(context(fleet))
        again, state = policy(context(fleet, state=state))
    assert replicas == again == 3
    [line] = [r.getMessage() for r in caplog.records]
    assert line.startswith("Denoiser: 1 -> 3 replicas: 25.0 s of work") and "/ 10 s per replica" in line


def test_stats_of_a_replica_that_measured_nothing_carry_no_work():
    unmeasured = ReplicaLoad("H100", PlanSummary("speed", 40, 0, 0.0), 4, (QueuedWork(IMAGE, 28),), (), (), NOW)
    assert autoscaling_stats(unmeasured) == {REQUESTS: 1.0}
    idle = autoscaling_stats(replica_load(0.1, 0), last_request_s=2.8)
    assert idle == {REQUESTS: 0.0, WORK_S: 0.0, REQUEST_S: 2.8}


def test_serve_accepts_the_policy_by_import_path_with_its_kwargs():
    config = AutoscalingConfig(min_replicas=1, max_replicas=4, policy={
        "policy_function": POLICY_PATH, "policy_kwargs": {"target_work_s": 12.0}})
    policy_class = config.policy.get_policy()
    assert policy_class.__name__ == "WorkPolicy"
    assert policy_class(**config.policy.policy_kwargs).target_work_s == 12.0
    with pytest.raises(ValueError, match="target_work_s"):
        WorkPolicy(0.0)
