"""The node ledger on a real multi-node Ray cluster: no over-commit, reclaim, restart."""
from __future__ import annotations

import pytest
import ray

from cluster.ledger.actor import HOST_POOL, NAMESPACE, LedgerConfig, ledger_name, node_ledger
from cluster.ledger.liveness import OwnerRef, actor_info
from offload_core.host.budget import Lease, Refusal
from offload_core.host.ram import default_reserve
from tests.cluster.conftest import FAST, MiB
from tests.cluster.replicas import on_node
from tests.waiting import wait_for


def test_a_ledger_config_that_could_lose_accounting_is_refused():
    with pytest.raises(ValueError, match="must cover two client heartbeats"):
        LedgerConfig(heartbeat_s=2.0, recovery_s=3.0)
    with pytest.raises(ValueError, match="owner_cap_fraction"):
        LedgerConfig(owner_cap_fraction=1.5)


def _state(node_id):
    return ray.get(node_ledger(node_id).state.remote(), timeout=60)


def test_each_node_has_one_ledger_pinned_to_it(fleet_nodes):
    for node in (fleet_nodes.small, fleet_nodes.l4, fleet_nodes.big):
        handle = ray.get_actor(ledger_name(node.node_id), namespace=NAMESPACE)
        assert actor_info(handle._actor_id.hex())["Address"]["NodeID"] == node.node_id
        # get-or-create: a second caller gets the same actor, not a second ledger.
        assert ray.get(node_ledger(node.node_id).epoch.remote()) == ray.get(handle.epoch.remote())
        state = _state(node.node_id)
        ram = int(node.ram_gb * 1e9)
        spendable = ram - default_reserve(ram) - 100 * MiB  # RAM - max(5 %, 2 GiB) - object store
        assert abs(state.pool(HOST_POOL).capacity - spendable) < 1e6, (
            "spendable must be the node's RAM less the reserve and Ray's object store")


def test_replicas_starting_at_once_never_lease_more_than_the_node_spendable(fleet_nodes):
    node = fleet_nodes.small
    before = _state(node.node_id).pool(HOST_POOL)
    chunk, per_replica = 600 * MiB, 4  # 6 replicas x 2.4 GiB asked of ~5.75 GB spendable
    replicas = [on_node(node.node_id).remote(f"pinner-{i}", FAST) for i in range(6)]
    try:
        results = ray.get([r.pin.remote(chunk, per_replica, float(i)) for i, r in enumerate(replicas)], timeout=120)
        granted = [x for rs in results for x in rs if isinstance(x, Lease)]
        refused = [x for rs in results for x in rs if isinstance(x, Refusal)]
        after = _state(node.node_id).pool(HOST_POOL)
        assert refused, "demand was 2.5x the spendable: some requests must have been refused"
        assert all("B free" in r.reason for r in refused), "a refusal must say what was free"
        assert before.leased + sum(l.nbytes for l in granted) == after.leased <= after.capacity
        assert after.peak_leased <= after.capacity, "the node over-committed its host RAM"
        assert after.capacity - after.leased < chunk, "requests were refused while a chunk still fit"
    finally:
        ray.get([r.close.remote() for r in replicas], timeout=60)
        for r in replicas:
            ray.kill(r)
    assert _state(node.node_id).pool(HOST_POOL).leased == before.leased, "closing must give every pin back"


def test_a_retried_request_gets_the_first_answer_not_a_second_lease(fleet_nodes):
    handle = node_ledger(fleet_nodes.big.node_id)
    ref = OwnerRef.of_this_process("retrying-driver")
    before = _state(fleet_nodes.big.node_id).pool(HOST_POOL).leased
    first, again = ray.get([handle.request.remote(HOST_POOL, 64 * MiB, ref, 1.0, "t", None, 0.0, None, "req-1")
                            for _ in range(2)])
    assert isinstance(first, Lease) and first == again
    assert _state(fleet_nodes.big.node_id).pool(HOST_POOL).leased == before + 64 * MiB
    ray.get(handle.release.remote(HOST_POOL, first.lease_id))
    assert ray.get(handle.release.remote(HOST_POOL, first.lease_id, None, True)) is None  # a retried release
    with pytest.raises(KeyError, match="not outstanding"):
        ray.get(handle.release.remote(HOST_POOL, first.lease_id))
    assert _state(fleet_nodes.big.node_id).pool(HOST_POOL).leased == before


def test_one_replica_cannot_take_more_than_its_cap(fleet_nodes):
    node = fleet_nodes.small
    state = _state(node.node_id)
    replica = on_node(node.node_id).remote("greedy", FAST)
    try:
        (first,) = ray.get(replica.pin.remote(state.owner_cap_bytes - 10 * MiB))
        (second,) = ray.get(replica.pin.remote(20 * MiB))
        assert isinstance(first, Lease)
        assert isinstance(second, Refusal) and "per-replica cap" in second.reason
    finally:
        ray.get(replica.close.remote())
        ray.kill(replica)


def test_a_replica_refused_pins_still_runs_on_mapped_layers_and_says_so(fleet_nodes):
    from offload_core.host.on_host import ComponentOnHost, LayerOnHost

    node = fleet_nodes.small
    crowd = [on_node(node.node_id).remote(f"crowd-{i}", FAST) for i in range(2)]  # each under its cap
    late = on_node(node.node_id).remote("late-denoiser", FAST)
    try:
        free = _state(node.node_id).pool(HOST_POOL).capacity - _state(node.node_id).pool(HOST_POOL).leased
        taken = ray.get([c.pin.remote((free - 1200 * MiB) // 2) for c in crowd])  # leaves ~1.2 GiB
        assert all(isinstance(t, Lease) for (t,) in taken)
        layers = tuple(LayerOnHost(f"blocks.{i}", 500 * MiB, 500 * MiB, 0) for i in range(8))  # 4 GiB mapped
        plan = ray.get(late.plan_hosting.remote([ComponentOnHost("transformer", layers, 50)]), timeout=120)
        assert plan["lease"].nbytes <= 1200 * MiB, "the plan must shrink to what the ledger has free"
        tiers = plan["tiers"]["transformer"]
        assert tiers["mapped"] >= 6 and tiers["pinned"] + tiers["pageable"] <= 2
        assert plan["reasons"], "the shortfall must be in the plan's reasons"
        log = plan["log"][0]
        assert f"{tiers['mapped']} mapped" in log and "free" in log, f"the log must say why it is mapped: {log}"
    finally:
        ray.get([r.close.remote() for r in (*crowd, late)], timeout=60)
        for r in (*crowd, late):
            ray.kill(r)


def test_killing_a_replica_returns_its_leases_within_the_bound(fleet_nodes):
    node = fleet_nodes.big
    start = _state(node.node_id)
    before, reclaimed = start.pool(HOST_POOL).leased, start.reclaimed_bytes
    replica = on_node(node.node_id).remote("doomed", FAST)
    leases = ray.get(replica.pin.remote(512 * MiB, 3))
    assert all(isinstance(l, Lease) for l in leases)
    assert _state(node.node_id).pool(HOST_POOL).leased == before + 3 * 512 * MiB
    ray.kill(replica)  # no close(): the ledger must notice on its own
    # Bound: one liveness interval (0.5 s) + a GCS lookup; 15 s only absorbs a loaded test machine.
    wait_for(lambda: _state(node.node_id).pool(HOST_POOL).leased == before, 15, "reclaim of a dead replica")
    # Given back by the liveness check (not by a close() or a release): exactly the dead replica's bytes.
    assert _state(node.node_id).reclaimed_bytes - reclaimed == 3 * 512 * MiB


def test_a_restarted_ledger_keeps_the_accounting(fleet_nodes):
    node = fleet_nodes.l4
    handle = node_ledger(node.node_id)
    old = ray.get(handle.state.remote())
    holder = on_node(node.node_id).remote("holder", FAST)
    other = on_node(node.node_id).remote("latecomer", FAST)
    try:
        (held,) = ray.get(holder.pin.remote(3 * 2**30))
        assert isinstance(held, Lease)
        ray.kill(handle, no_restart=False)  # the ledger dies; Ray restarts it (max_restarts=-1)
        new = wait_for(lambda: _fresh_state(node.node_id, old.epoch), 60, "the ledger's restart")
        assert new.restarted
        # The holder's heartbeat (0.5 s) re-registers its lease inside the 2 s recovery window.
        restored = wait_for(lambda: _has_lease(node.node_id, held.lease_id), 30, "re-registration")
        assert restored.pool(HOST_POOL).leased >= held.nbytes
        free = restored.pool(HOST_POOL).capacity - restored.pool(HOST_POOL).leased
        (late,) = ray.get(other.pin.remote(free + MiB), timeout=60)
        assert isinstance(late, Refusal), "the restarted ledger granted bytes the holder still has"
    finally:
        ray.get([holder.close.remote(), other.close.remote()], timeout=60)
        ray.kill(holder)
        ray.kill(other)
    assert _state(node.node_id).pool(HOST_POOL).leased == 0


def _fresh_state(node_id, old_epoch):
    try:
        state = _state(node_id)
    except ray.exceptions.RayActorError:
        return None
    return state if state.epoch != old_epoch else None


def _has_lease(node_id, lease_id):
    handle = node_ledger(node_id)
    leases = ray.get(handle.outstanding.remote(HOST_POOL))
    return ray.get(handle.state.remote()) if any(l.lease_id == lease_id for l in leases) else None
