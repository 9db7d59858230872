"""A stand-in stage replica for the cluster tests: leases through ReplicaMemory like a real one."""
from __future__ import annotations

import os
import time

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from cluster.ledger.actor import LedgerConfig
from cluster.replica.ledger_view import ReplicaMemory


@ray.remote(num_cpus=0)
class LeasingReplica:
    def __init__(self, owner: str, config: LedgerConfig, device: str = "cpu"):
        self.memory = ReplicaMemory.open(owner, device, config=config)
        self.leases = None
        self.call_leases = None

    def facts(self) -> dict:
        m = self.memory
        return {"pid": os.getpid(), "node_id": m.node.node_id, "pool": m.device_pool,
                "profile": m.profile.name, "mode": m.profile.mode,
                "gpu": m.node.gpus[0].name if m.node.gpus else None, "share": m.share_bytes,
                "pool_bytes": m.device_budget.capacity(), "fraction": m.process_memory_fraction()}

    def reserved_call(self, standing: int, nbytes: int, hold_s: float, timeout_s: float,
                      idle_s: float | None = None) -> tuple[str, float]:
        """A stage call under DeviceLeases: standing lease, then a call reservation kept afterwards
        (``idle_s``: how long it is kept unused, at the first call; the product's default if None)."""
        from cluster.replica.device_leases import LeaseRefused

        if self.leases is None:
            self.leases = self.memory.device_leases(idle_s=idle_s)
            self.leases.hold_standing(standing, timeout_s)
        start = time.monotonic()
        try:
            with self.leases.call(nbytes, timeout_s):
                time.sleep(hold_s)
        except LeaseRefused as refused:
            return "refused", refused.waited_s
        return "ok", time.monotonic() - start

    def lease_figures(self) -> dict:
        return self.leases.figures().to_json()

    def watch_neighbours(self) -> None:
        """Give the replica's device its neighbours' outstanding leases (as deployments/replica/leases.py does)."""
        from offload_core.streaming.device import get_device

        get_device("cpu").set_neighbours(self.memory.neighbour_leases())

    def neighbours_outstanding(self) -> int:
        """What the device's headroom leaves to neighbours now."""
        from offload_core.streaming.device import get_device

        return get_device("cpu").headroom().neighbours_outstanding

    def pin(self, nbytes: int, count: int = 1, priority: float = 0.0) -> list:
        return [self.memory.host_budget.request(nbytes, self.memory.owner, priority, "pinned:test")
                for _ in range(count)]

    def stage_call(self, nbytes: int, hold_s: float, timeout_s: float, until: str | None = None) -> tuple[str, float]:
        """One stage call: lease the working set, 'compute' for hold_s (or, given ``until``, until that
        file exists, at most hold_s), give it back."""
        from cluster.replica.device_leases import LeaseRefused

        if self.call_leases is None:  # kept between calls, recalled by the ledger when a neighbour waits
            self.call_leases = self.memory.device_leases(idle_s=0.2)
        start = time.monotonic()
        try:
            with self.call_leases.call(nbytes, timeout_s):
                if until is None:
                    time.sleep(hold_s)
                else:
                    while not os.path.exists(until) and time.monotonic() - start < hold_s:
                        time.sleep(0.02)
        except LeaseRefused as refused:
            return "busy", refused.waited_s
        return "ok", time.monotonic() - start

    def plan(self, components, stages, working_set_bytes: int) -> dict:
        """Plan from what this replica sees (its GPU pool, link, host lease and profile)."""
        from cluster.replica.plan import plan_for_replica, replica_facts

        facts = replica_facts(self.memory, components, stages, working_set_bytes)
        plan = plan_for_replica(self.memory.profile, facts, owner=self.memory.owner)
        return {"mode": plan.mode.value, "feasible": plan.feasible, "peak": plan.peak_device_bytes,
                "capacity": plan.device_capacity,
                "strategies": {c.name: c.strategy.value for c in plan.components}}

    def plan_hosting(self, components) -> dict:
        """offload_core's hosting plan against the node ledger's host pool."""
        from offload_core.host.hosting import plan_hosting

        plan = plan_hosting(components, self.memory.host_budget, self.memory.owner)
        return {"lease": plan.lease, "reasons": plan.reasons,
                "tiers": {c.name: {t.value: c.count(t) for t in type(c.tiers[0][1])} for c in plan.components},
                "log": [c.log_line() for c in plan.components]}

    def close(self) -> int:
        if self.leases is not None:
            self.leases.close()
        return self.memory.close()


def on_node(node_id: str, **options):
    return LeasingReplica.options(
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False), **options)
