"""Can the deployments' GPU shares be placed on the cluster's GPUs? Pure arithmetic over frozen facts.

Ray places a replica asking ``num_gpus: f`` (f < 1) on ONE GPU with at least f of it unallocated
(fractions never span GPUs), and one asking a whole number k on k whole free GPUs of one node; an
``accelerator_type`` restricts it to nodes with that type. ``num_gpus`` is logical: Ray never looks
at memory, so the deployment's fractions must add up per GPU, or replicas wait, unplaced, forever
on a cluster without an autoscaler.

Two questions, two functions:

- :func:`shortfalls`: can the configured maximum (num_replicas, or autoscaling max_replicas, of
  every deployment) ever be placed on the cluster's GPUs (whole-node totals)? ``build_app`` warns
  when not (deployments/app.py).
- :func:`why_pending`: a replica Ray has not placed: which node falls short of what it wants, with
  the numbers (``GET /v1/residency`` → ``pending``).

Shares are counted in Ray's resource unit, 1/10000 of a GPU, so 0.2 + 0.6 + 0.2 is exactly one.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

UNITS = 10_000  # Ray stores resource quantities as multiples of 1/10000


def units(gpus: float) -> int:
    return round(gpus * UNITS)


@dataclass(frozen=True)
class GpuDemand:
    """One deployment's replicas, as far as GPUs go."""

    deployment: str
    num_gpus: float  # per replica (ray_actor_options.num_gpus)
    replicas: int  # the configured maximum: num_replicas, or autoscaling_config.max_replicas
    accelerator_type: str | None = None  # ray_actor_options.accelerator_type, if set


@dataclass(frozen=True)
class GpuNode:
    """One alive Ray node's GPUs: how many, and (for a pending replica's reason) how much is unallocated."""

    node_id: str
    gpus: int
    free_gpus: float  # Ray's available GPU on the node (all of it when planning against totals)
    accelerator_types: frozenset[str] = field(default_factory=frozenset)

    def short(self) -> str:
        return self.node_id[:8]


@dataclass(frozen=True)
class Shortfall:
    """Replicas of one deployment that can never be placed beside the others' on the cluster's GPUs."""

    deployment: str
    num_gpus: float
    wanted: int
    placed: int

    def describe(self) -> str:
        return (f"{self.deployment} wants {self.wanted} x {self.num_gpus:g} GPU, at most {self.placed} "
                f"can be placed")


def _fits(node: GpuNode, demand: GpuDemand) -> bool:
    return demand.accelerator_type is None or demand.accelerator_type in node.accelerator_types


def shortfalls(demands: Sequence[GpuDemand], nodes: Sequence[GpuNode]) -> tuple[Shortfall, ...]:
    """Pack every replica of every demand onto the nodes' whole GPUs (totals, not what is free now),
    largest share first, each onto the first GPU (or GPUs, for a whole-number ask) it fits; return the
    deployments with replicas left over. First-fit decreasing, as Ray places replicas one by one; it is
    exact for the configs shipped here (one or two share sizes per GPU)."""
    free = {node.node_id: [UNITS] * node.gpus for node in nodes}
    items = sorted(((units(d.num_gpus), i, d) for i, d in enumerate(demands) for _ in range(d.replicas)
                    if d.num_gpus > 0), key=lambda item: (-item[0], item[1]))
    placed = {d.deployment: 0 for d in demands}
    for want, _, demand in items:
        for node in nodes:
            gpus = free[node.node_id]
            if not _fits(node, demand):
                continue
            if want >= UNITS:
                whole = [i for i, left in enumerate(gpus) if left == UNITS][:math.ceil(want / UNITS)]
                if len(whole) * UNITS < want:
                    continue
                for i in whole:
                    gpus[i] = 0
            else:
                slot = next((i for i, left in enumerate(gpus) if left >= want), None)
                if slot is None:
                    continue
                gpus[slot] -= want
            placed[demand.deployment] += 1
            break
    return tuple(Shortfall(d.deployment, d.num_gpus, d.replicas, placed[d.deployment])
                 for d in demands if d.num_gpus > 0 and placed[d.deployment] < d.replicas)


def capacity_warning(demands: Sequence[GpuDemand], nodes: Sequence[GpuNode]) -> str | None:
    """One line naming every deployment whose configured maximum can never be placed, or None."""
    short = shortfalls(demands, nodes)
    if not short:
        return None
    asked = sum(d.num_gpus * d.replicas for d in demands)
    gpus = sum(n.gpus for n in nodes)
    return (f"the configured maximum replicas can never all be placed on this cluster's GPUs ({gpus} GPU(s) on "
            f"{len(nodes)} node(s), no autoscaler; {asked:g} GPU asked in all): "
            + "; ".join(s.describe() for s in short)
            + ". The rest would wait unplaced: lower num_replicas/max_replicas or num_gpus, or add GPUs")


def _node_shortage(node: GpuNode, demand: GpuDemand) -> str:
    if not _fits(node, demand):
        return f"node {node.short()} is not {demand.accelerator_type}"
    if node.gpus == 0:
        return f"node {node.short()} has no GPU"
    if demand.num_gpus > node.gpus:
        return f"node {node.short()} has {node.gpus} GPU(s)"
    return f"node {node.short()} has {node.free_gpus:g} of {node.gpus} GPU(s) free"


def why_pending(demand: GpuDemand, nodes: Sequence[GpuNode]) -> str:
    """Why a replica wanting ``demand.num_gpus`` is not placed, node by node, with the numbers. A
    fractional ask needs that much of ONE GPU; per node only the total free share is known, so a node
    whose free total covers the ask is reported as having room (Ray then places it soon)."""
    want = units(demand.num_gpus)
    roomy = [n for n in nodes if _fits(n, demand) and units(n.free_gpus) >= want and n.gpus * UNITS >= want]
    if demand.num_gpus <= 0:
        return "wants no GPU: waiting for Ray to start its worker (CPU, memory or a custom resource)"
    if roomy:
        node = roomy[0]
        if demand.num_gpus < 1 < node.gpus:  # Ray reports a node's free share summed over its GPUs
            return (f"wants {demand.num_gpus:g} of one GPU; node {node.short()} has {node.free_gpus:g} free across "
                    f"its {node.gpus} GPUs: placed once one of them has {demand.num_gpus:g} free")
        return (f"wants {demand.num_gpus:g} GPU; node {node.short()} has {node.free_gpus:g} free: "
                f"waiting for Ray to start its worker")
    where = "one GPU" if demand.num_gpus < 1 else "one node"
    return (f"wants {demand.num_gpus:g} GPU on {where}; no alive node has it free: "
            + ", ".join(_node_shortage(n, demand) for n in nodes) if nodes else "the cluster has no alive node")


@dataclass(frozen=True)
class PendingReplica:
    """A replica Ray has not placed yet (``GET /v1/residency`` → ``pending``)."""

    deployment: str
    replica: str
    wanted: tuple[tuple[str, float], ...]  # resource -> amount per replica (num_gpus as "GPU", ...)
    waiting_s: float  # since Serve asked for it
    reason: str  # :func:`why_pending`: which node falls short of what, with the numbers
    ray_message: str = ""  # Serve's own deployment message (after 30 s: "... taken more than 30s to be scheduled")

    def to_json(self) -> dict:
        return {"deployment": self.deployment, "replica": self.replica, "wanted": dict(self.wanted),
                "waiting_s": round(self.waiting_s, 1), "reason": self.reason,
                **({"ray_message": self.ray_message} if self.ray_message else {})}
