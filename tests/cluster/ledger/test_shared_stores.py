"""The node ledger counts a shared weight store once, with its replicas; dead ones are detached."""
from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import ray
import torch

from cluster.ledger.actor import HOST_POOL, NAMESPACE, ledger_name, node_ledger
from offload_core.shared_store.store import store_dir
from tests.cluster.conftest import FAST
from tests.cluster.store_replicas import store_replica
from tests.offload_core.residency.test_lifecycle import Toy
from tests.waiting import wait_for


def expected(x):
    return {"a": Toy(0)(x), "b": Toy(1)(x)}

def test_two_replicas_share_one_leased_copy_and_a_killed_one_is_detached(fleet_nodes):
    node = fleet_nodes.big.node_id
    ledger = node_ledger(node, FAST)
    identity = uuid.uuid4().hex
    x = torch.randn(3, 16)
    r1, r2 = store_replica(node, "store-r1", FAST), store_replica(node, "store-r2", FAST)
    first = ray.get(r1.host.remote(identity), timeout=120)
    before = ray.get(ledger.state.remote()).pool(HOST_POOL).leased
    second = ray.get(r2.host.remote(identity, spoil=True), timeout=120)
    assert set(first["roles"].values()) == {"create"} and set(second["roles"].values()) == {"attach"}
    assert ray.get(ledger.state.remote()).pool(HOST_POOL).leased == before, "the second replica leases nothing"
    ours = [s for s in ray.get(ledger.stores.remote()) if s.path in first["paths"]]
    assert len(ours) == 2 and all(s.attached == ("store-r1", "store-r2") for s in ours)
    for replica in (r1, r2):
        got = ray.get(replica.forward.remote(x), timeout=60)
        assert all(torch.equal(got[n], v) for n, v in expected(x).items())

    ray.kill(r1, no_restart=True)
    wait_for(lambda: all(s.attached == ("store-r2",) for s in ray.get(ledger.stores.remote())
                         if s.path in first["paths"]), what="the killed replica detached")
    assert all(Path(p).exists() for p in first["paths"]), "the survivor still maps the copy"
    got = ray.get(r2.forward.remote(x), timeout=60)
    assert all(torch.equal(got[n], v) for n, v in expected(x).items())

    ray.kill(r2, no_restart=True)
    wait_for(lambda: not [s for s in ray.get(ledger.stores.remote()) if s.path in first["paths"]],
             what="the store reclaimed when its last replica died")
    assert not any(Path(p).exists() for p in first["paths"]), "the shared memory is removed"
    leased = ray.get(ledger.state.remote()).pool(HOST_POOL).leased
    assert leased == before - sum(s.nbytes for s in ours), "the one lease went back"

def test_a_replica_attaching_to_a_changed_store_is_refused_and_holds_nothing(fleet_nodes):
    node = fleet_nodes.big.node_id
    ledger = node_ledger(node, FAST)
    identity = uuid.uuid4().hex
    r1, r2 = store_replica(node, "store-m1", FAST), store_replica(node, "store-m2", FAST)
    first = ray.get(r1.host.remote(identity), timeout=120)
    for path in first["paths"]:
        with open(path, "r+b") as f:  # a sampled page (the first data page) no longer what was written
            f.seek(2 * 4096)
            f.write(b"\x00\x11\x22\x33")
    with pytest.raises(ray.exceptions.RayTaskError, match="sampled pages differ"):
        ray.get(r2.host.remote(identity), timeout=120)
    ours = [s for s in ray.get(ledger.stores.remote()) if s.path in first["paths"]]
    assert all(s.attached == ("store-m1",) for s in ours), "the refused replica is not counted"
    ray.get(r1.remove.remote(), timeout=60)
    assert not [s for s in ray.get(ledger.stores.remote()) if s.path in first["paths"]]
    for actor in (r1, r2):
        ray.kill(actor, no_restart=True)

def test_a_store_left_by_a_crashed_process_is_removed_when_the_ledger_starts(fleet_nodes):
    node = fleet_nodes.l4.node_id
    ledger = node_ledger(node, FAST)
    epoch = ray.get(ledger.epoch.remote())
    orphan = store_dir() / f"offload-serve-{uuid.uuid4().hex[:24]}.weights"
    # A process that wrote a store and died: nothing holds the file any more.
    subprocess.run([sys.executable, "-c", f"open({str(orphan)!r}, 'wb').write(b'x' * 8192)"], check=True,
                   env={**os.environ})
    assert orphan.exists()
    ray.kill(ray.get_actor(ledger_name(node), namespace=NAMESPACE), no_restart=False)
    wait_for(lambda: _epoch_or_none(ledger) not in (None, epoch), timeout_s=60, what="the ledger restarted")
    assert not orphan.exists(), "the restarted ledger swept the orphaned store"

def _epoch_or_none(ledger):
    try:
        return ray.get(ledger.epoch.remote(), timeout=5)
    except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
        return None


def test_a_restarted_ledger_hears_of_the_attached_replicas_and_counts_the_copy_once(fleet_nodes):
    node = fleet_nodes.small.node_id
    ledger = node_ledger(node, FAST)
    identity = uuid.uuid4().hex
    r1, r2 = store_replica(node, "store-e1", FAST), store_replica(node, "store-e2", FAST)
    first = ray.get(r1.host.remote(identity), timeout=120)
    ray.get(r2.host.remote(identity), timeout=120)
    ours = [s for s in ray.get(ledger.stores.remote()) if s.path in first["paths"]]
    epoch = ray.get(ledger.epoch.remote())
    ray.kill(ray.get_actor(ledger_name(node), namespace=NAMESPACE), no_restart=False)
    wait_for(lambda: _epoch_or_none(ledger) not in (None, epoch), timeout_s=60, what="the ledger restarted")
    wait_for(lambda: [s.attached for s in ray.get(ledger.stores.remote()) if s.path in first["paths"]]
             == [("store-e1", "store-e2")] * len(ours), what="both replicas re-registered their stores")
    leased = ray.get(ledger.state.remote()).pool(HOST_POOL).leased
    assert leased >= sum(s.nbytes for s in ours), "the restarted ledger counts the copies"
    assert all(Path(p).exists() for p in first["paths"]), "live replicas' stores survive the restart's sweep"
    for actor in (r1, r2):
        ray.get(actor.remove.remote(), timeout=60)
    assert not [s for s in ray.get(ledger.stores.remote()) if s.path in first["paths"]]
    assert ray.get(ledger.state.remote()).pool(HOST_POOL).leased == leased - sum(s.nbytes for s in ours)
    for actor in (r1, r2):
        ray.kill(actor, no_restart=True)
