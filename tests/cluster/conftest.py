"""Fake GPU nodes on the session's Ray cluster, shared by the cluster tests.

Each node advertises its RAM and GPU type as custom resources (cluster/node.py reads them), so a
"12 GB" node, a "24 GB" L4 node and an "80 GB" H100 node coexist on this one machine.
"""
from __future__ import annotations

from dataclasses import dataclass

import pytest
import ray

from cluster.ledger.actor import LedgerConfig, node_ledger
from tests.conftest import QUIET_NODE

# Fast enough for tests: a dead replica's leases come back within ~0.5 s + one GCS lookup.
FAST = LedgerConfig(liveness_interval_s=0.5, heartbeat_s=0.5, recovery_s=2.0)
MiB = 2**20


@dataclass(frozen=True)
class FakeNode:
    node_id: str
    accelerator_type: str
    ram_gb: float


@dataclass(frozen=True)
class Fleet:
    small: FakeNode  # RTX3060, 12 GB, 8 GB RAM
    l4: FakeNode  # L4, 24 GB, 16 GB RAM
    big: FakeNode  # H100, 80 GB, 64 GB RAM


# Package scope: the fake GPU nodes go when tests/cluster is done, so later packages' replicas
# (tests/deployments fills its own node's ledger) only ever land on the head node.
@pytest.fixture(scope="package")
def fleet_nodes(ray_cluster):
    specs = {"small": ("RTX3060", 8), "l4": ("L4", 16), "big": ("H100", 64)}
    added, nodes = [], {}
    for key, (gpu, ram_gb) in specs.items():
        node = ray_cluster.add_node(**QUIET_NODE, num_cpus=1, num_gpus=1, object_store_memory=100 * MiB,
                                    resources={f"accelerator_type:{gpu}": 1, "offload_fake_ram_gb": ram_gb})
        added.append(node)
        nodes[key] = FakeNode(node.node_id, gpu, ram_gb)
    ray_cluster.wait_for_nodes()
    # Created once with the fast config: the first creator's config wins for the node's life.
    ray.get([node_ledger(n.node_id, FAST).epoch.remote() for n in nodes.values()], timeout=120)
    try:
        yield Fleet(**nodes)
    finally:
        for node in nodes.values():
            ray.kill(ray.get_actor(f"offload-ledger-{node.node_id}", namespace="offload-serve"), no_restart=True)
        for node in added:
            ray_cluster.remove_node(node)
