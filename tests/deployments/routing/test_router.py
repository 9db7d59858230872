"""PredictedFinishRouter in-process: Serve's interface (ranks, routed/completed hooks) over fake replicas."""
import asyncio
import concurrent.futures
from dataclasses import dataclass
from types import SimpleNamespace

import pytest

from deployments.capacity.replica_load import PlanSummary, QueuedWork, ReplicaLoad, Shape, StepTiming
from deployments.routing import outcomes
from deployments.routing import router as routing
from deployments.routing.router import PredictedFinishRouter, spec_of
from deployments.wire.spec import GenerationSpec

IMAGE = Shape(64, 64, 1)


@dataclass(frozen=True)
class FakeReplicaID:
    unique_id: str


class FakeReplica:
    """What the router reads of Serve's RunningReplica: its id and its routing stats."""

    def __init__(self, name: str, stats: dict):
        self.replica_id, self.routing_stats = FakeReplicaID(name), stats


def stats(step_s: float, at_s: float, gpu: str = "L4", running=()) -> dict:
    load = ReplicaLoad(gpu, PlanSummary("speed", 40, 0, 0.0), 4, tuple(running), (),
                       (StepTiming(IMAGE, 1, step_s, 5),), at_s)
    return load.to_stats()


def pending(request_id: str, steps: int = 10):
    spec = GenerationSpec(request_id, "a fox", None, IMAGE.height, IMAGE.width, 1, steps, 5.0, 0, 1)
    metadata = SimpleNamespace(request_id=request_id, internal_request_id=f"internal-{request_id}")
    # Serve sets the future to the replica it picked (an asyncio future; this one runs its callbacks at once).
    return SimpleNamespace(args=["encoded", spec], kwargs={}, metadata=metadata, future=concurrent.futures.Future())


@pytest.fixture
def router():
    made = PredictedFinishRouter.__new__(PredictedFinishRouter)  # Serve's constructor wants its own internals
    made.initialize_state(stats_period_s=0.5)
    return made


def test_the_request_spec_is_read_from_the_denoise_call():
    assert spec_of(pending("r1")).request_id == "r1"
    assert spec_of(SimpleNamespace(args=[], kwargs={}, metadata=None)) is None  # residency(), ...


def test_replicas_come_back_one_per_rank_fastest_finish_first(router, monkeypatch):
    monkeypatch.setattr(routing.time, "time", lambda: 100.0)
    slow, fast = FakeReplica("slow", stats(0.3, 99.9, "L4")), FakeReplica("fast", stats(0.1, 99.9, "H100"))
    ranks = asyncio.run(router.choose_replicas([slow, fast], pending("r1")))
    assert ranks == [[fast], [slow]]


def test_a_routed_request_counts_on_its_replica_until_the_next_stats(router, monkeypatch):
    clock = [100.0]
    monkeypatch.setattr(routing.time, "time", lambda: clock[0])
    a, b = FakeReplica("a", stats(0.1, 99.9)), FakeReplica("b", stats(0.12, 99.9))
    assert asyncio.run(router.choose_replicas([a, b], pending("first")))[0] == [a]
    for i in range(5):  # five 10-step images to a: a batch of 4 and one behind it
        request = pending(f"r{i}")
        router.decide([a, b], request, clock[0])
        router.on_request_routed(request, a.replica_id, result=None)
    assert asyncio.run(router.choose_replicas([a, b], pending("r5")))[0] == [b]
    # New stats taken after those were sent carry them itself: the router stops adding them.
    a.routing_stats = stats(0.1, 100.5, running=[QueuedWork(IMAGE, 10)] * 4)
    clock[0] = 100.6
    # The batch of 4 (0.175 s a step), then the new one alone, less the 0.1 s run since the stats.
    assert router.decide([a, b], pending("r6"), clock[0]).prediction("a").finish_s == pytest.approx(
        10 * 0.175 + 10 * 0.1 - 0.1)


def test_a_completed_request_records_predicted_and_actual_finish(router, monkeypatch):
    clock = [100.0]
    monkeypatch.setattr(routing.time, "time", lambda: clock[0])
    fast = FakeReplica("fast", stats(0.1, 99.9, "H100"))
    request = pending("done-1")
    asyncio.run(router.choose_replicas([fast], request))
    request.future.set_result(fast)  # Serve routed it there (its on_request_routed hook may not come)
    clock[0] = 101.1
    router.on_request_completed(fast.replica_id, request.metadata.internal_request_id)
    outcome = outcomes.OUTCOMES[-1]
    assert (outcome.request_id, outcome.gpu_type, outcome.rule) == ("done-1", "H100", "predicted")
    assert outcome.predicted_s == pytest.approx(1.0) and outcome.actual_s == pytest.approx(1.1)
