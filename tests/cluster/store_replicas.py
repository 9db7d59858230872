"""A stand-in stage replica that hosts toy layers from the node weight store through the ledger."""
from __future__ import annotations

import os

import ray
import torch
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from cluster.ledger.actor import LedgerConfig
from cluster.replica.ledger_view import ReplicaMemory


@ray.remote(num_cpus=0, max_restarts=0)
class StoreReplica:
    def __init__(self, owner: str, config: LedgerConfig):
        self.memory = ReplicaMemory.open(owner, "cpu", config=config)
        self.models = self.residency = None

    def host(self, identity: str, budget: int | None = None, spoil: bool = False) -> dict:
        from offload_core.residency.lifecycle import PipelineResidency
        from offload_core.shared_store.hosting import SharedWeights
        from offload_core.streaming.device import DeviceCapacity, get_device
        from tests.offload_core.residency.test_lifecycle import Toy, toy_plan

        get_device("cpu").configure(DeviceCapacity(capacity_bytes=1 << 30))
        self.models = {"a": Toy(0), "b": Toy(1)}
        if spoil:  # a bitwise-equal output then proves the layers came from the store
            for model in self.models.values():
                for p in model.blocks.parameters():
                    p.data.fill_(float("nan"))
        shared = SharedWeights(self.memory.store_registry(), {"a": f"{identity}-a", "b": f"{identity}-b"},
                               self.memory.owner, budget_bytes=budget)
        self.residency = PipelineResidency.apply(self.models, toy_plan(1 << 30), "cpu", self.memory.host_budget,
                                                 owner=self.memory.owner, shared=shared)
        return {"pid": os.getpid(), "roles": {c: r.value for c, r in shared.roles().items()},
                "paths": sorted(str(s.path) for s in shared._stores.values())}

    def forward(self, x: torch.Tensor) -> dict:
        out = {}
        for name, model in self.models.items():
            with self.residency.stage([name]):
                out[name] = model(x)
        return out

    def remove(self) -> None:
        self.residency.remove()


def store_replica(node_id: str, owner: str, config: LedgerConfig):
    return StoreReplica.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False)).remote(
        owner, config)
