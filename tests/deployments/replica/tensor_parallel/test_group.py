"""A tensor-parallel replica's ranks (ShardGroup) when a rank hangs: past the collective timeout it is dead.

No Serve app: the group runs in a plain actor placed in a 2-bundle placement group, as a TextEncoder
replica at tp_size 2 does, with the tiny Wan encoder on 2 gloo ranks and a 3 s collective timeout
(the service's is 60 s). A rank stuck in its call (asleep, not dead: no peer sees a socket close)
leaves the other waiting in the encoder's first collective; the timeout ends the wait, the call
fails with RankLost (the API's 503 replica_unavailable), the health check fails from then on (Serve
replaces the replica), both rank actors are killed and the node ledger gets every lease back.
"""
from __future__ import annotations

import time

import pytest

from deployments.api.errors import overload_or_failure
from deployments.app import StageArgs, stage_configs
from deployments.ingress.failures import sort_failure
from deployments.models import families
from deployments.wire.spec import GenerationSpec, PipelineStage, RankLost
from tests.deployments.conftest import tiny_args
from zoo.tiny import ensure_tiny_wan

TIMEOUT_S = 3.0
REPLICA = "SERVE_REPLICA::shards-test#Hung#r1"
SPEC = GenerationSpec("hung", "a heron", None, 16, 16, 5, 2, 5.0, 1, 1)
HUNG_S = 600.0  # far past every timeout: the rank is only ever ended by the group killing it


def hang_on_rank_1(worker, spec):
    """Rank 1 stops answering inside its call; rank 0 runs the encode and meets it in a collective."""
    from deployments.replica.stages import encode_on

    if worker.replica.endswith("/rank1"):
        time.sleep(HUNG_S)
    return encode_on(worker, spec)


def _holder_class():
    import ray

    @ray.remote(num_cpus=0, max_restarts=0, max_task_retries=0)
    class GroupHolder:
        """Stands in for the TextEncoder replica: holds the ShardGroup in the placement group's bundle 0."""

        def __init__(self, config):
            from deployments.replica.tensor_parallel.group import ShardGroup

            self.group = ShardGroup(config, REPLICA, 2, timeout_s=TIMEOUT_S)

        def call(self, fn, spec):
            from deployments.replica.stages import encode_on

            start = time.monotonic()
            try:
                self.group.call(fn if fn is not None else encode_on, spec)
                return None, time.monotonic() - start
            except RankLost as lost:
                return lost, time.monotonic() - start

        def health(self):
            try:
                self.group.check_health()
                return None
            except RankLost as lost:
                return lost

        def rank_ids(self):
            return [f"{REPLICA}/rank{i.rank}" for i in self.group.identities]

    return GroupHolder


@pytest.fixture(scope="module")
def holder(ray_cluster):
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    facts = families.read_family_traits(ensure_tiny_wan())
    config = stage_configs(tiny_args(encoder=StageArgs(tp_size=2)), facts)[PipelineStage.ENCODE]
    group = placement_group([{"CPU": 0.5}, {"CPU": 0.5}], strategy="STRICT_PACK")
    ray.get(group.ready(), timeout=120)
    actor = _holder_class().options(scheduling_strategy=PlacementGroupSchedulingStrategy(
        group, placement_group_bundle_index=0, placement_group_capture_child_tasks=True)).remote(config)
    try:
        yield actor
    finally:
        ray.kill(actor, no_restart=True)
        remove_placement_group(group)


def test_a_rank_hung_past_the_collective_timeout_is_dead_503_unhealthy_and_its_leases_come_back(holder):
    import ray

    from cluster.ledger.actor import node_ledger

    lost, seconds = ray.get(holder.call.remote(None, SPEC), timeout=300)
    assert lost is None, f"the group answers before anything hangs: {lost}"
    ranks = ray.get(holder.rank_ids.remote(), timeout=60)
    ledger = node_ledger()
    assert all(ray.get(ledger.outstanding.remote(owner=r)) for r in ranks), "each rank holds its leases"
    lost, seconds = ray.get(holder.call.remote(hang_on_rank_1, SPEC), timeout=300)
    # Rank 0's collective gives up at the timeout (gloo); the group waits at most twice it for rank 1.
    assert isinstance(lost, RankLost), lost
    assert TIMEOUT_S * 0.9 <= seconds <= 2 * TIMEOUT_S + 30, seconds
    print(f"hung rank: the call failed after {seconds:.1f} s (collective timeout {TIMEOUT_S} s): {lost}")
    response = overload_or_failure(sort_failure(lost), 2, "req-hung")
    assert response.status_code == 503 and response.headers["retry-after"] == "2"
    assert b'"code":"replica_unavailable"' in response.body
    assert isinstance(ray.get(holder.health.remote(), timeout=60), RankLost), "the health check fails for good"
    again, _ = ray.get(holder.call.remote(None, SPEC), timeout=60)
    assert isinstance(again, RankLost), "a broken group refuses every later call at once"
    deadline = time.monotonic() + 60  # both rank actors were killed: the ledger reclaims what they leased
    while any(ray.get(ledger.outstanding.remote(owner=r)) for r in ranks) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not any(ray.get(ledger.outstanding.remote(owner=r)) for r in ranks), ranks
