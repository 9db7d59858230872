"""A replica's plan from what it sees: its GPU's pool, its PCIe link, its host lease, its profile.

The same pipeline facts give a 12 GB replica a streamed plan and an 80 GB one a resident plan,
chosen from the GPU the replica sees (its fleet profile, configs/fleet/fleet.yaml): the mode when
the stage's configuration leaves it to the fleet, and always the profile's limits (prefetch depth,
the most resident layers, the most host memory one replica may pin). Every stage replica of the
service plans here (``deployments.replica.stage_residency.StageResidency``).
"""
from __future__ import annotations

import dataclasses
import logging
import math
from typing import TYPE_CHECKING, Sequence

from cluster.fleet import FleetProfile
from cluster.node import GB, GpuFacts
from cluster.replica.ledger_view import ReplicaMemory
from offload_core.planner.facts import ComponentProfile, LinkFacts, PipelineFacts, Stage
from offload_core.planner.gpus import link_Bps
from offload_core.planner.search import (
    ComponentOverride,
    PerformanceMode,
    PipelinePlan,
    plan_pipeline,
)
from offload_core.planner.strategy import Strategy
from offload_core.streaming.fill_threads import default_cap, usable_cpus
from offload_core.streaming.link import measure_link

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)


def link_facts(device: "torch.device | None" = None, gpu: GpuFacts | None = None,
               copier_cap: int | None = None) -> LinkFacts:
    """The replica's link to its device: measured on CUDA (staged fills split over at most ``copier_cap``
    threads, :func:`copier_cap`); elsewhere (nothing to measure) the GPU table's bandwidths for the
    link ``gpu`` reports, or the table's default link without one."""
    if device is not None and device.type == "cuda":
        return measure_link(device, copier_cap=copier_cap)
    pinned, pageable = link_Bps(gpu.pcie_gen if gpu else None, gpu.pcie_width if gpu else None)
    return LinkFacts(pinned, pageable, measured=False)


def replicas_sharing_node(memory: ReplicaMemory) -> int:
    """How many replicas the node's cores are shared among: one per GPU, or per GPU share where a
    replica asked Ray for a fraction of one (num_gpus 0.5: two per GPU); 1 on a node without GPUs."""
    per_gpu = 1 if not memory.gpu_fraction else max(1, math.floor(1 / memory.gpu_fraction + 1e-9))
    return max(1, len(memory.node.gpus)) * per_gpu


def copier_cap(memory: ReplicaMemory) -> int:
    """The most threads this replica's staging fills may split over: min(8, cores // replicas sharing
    the node), so replicas streaming at once on one node do not oversubscribe its cores."""
    sharing = replicas_sharing_node(memory)
    cap = default_cap(sharing)
    logger.info("%s: staging fills split over at most %d copier threads (%d cores, %d replicas sharing the node)",
                memory.owner, cap, usable_cpus(), sharing)
    return cap


def replica_gpu(memory: ReplicaMemory) -> GpuFacts | None:
    """The GPU whose pool the replica leases (None: it computes on the host)."""
    return next((g for g in memory.node.gpus if f"gpu:{g.index}" == memory.device_pool), None)


def pin_cap_bytes(memory: ReplicaMemory) -> int:
    """The most host memory one replica may page-lock: its profile's share of the node's spendable RAM."""
    return int(memory.node.ram.spendable * memory.profile.host_pin_cap_fraction)


def replica_facts(memory: ReplicaMemory, components: Sequence[ComponentProfile], stages: Sequence[Stage],
                  working_set_bytes: int = 0, *, device_capacity: int | None = None, link: LinkFacts | None = None,
                  host_lease_bytes: int | None = None) -> PipelineFacts:
    """Pipeline facts for this replica: device capacity = its GPU pool, host lease = within its pin cap.

    ``device_capacity``, ``link`` and ``host_lease_bytes`` replace what the replica sees (a link
    measured on CUDA, a host lease already within the node's free bytes and the stage's budget);
    the host lease never exceeds the profile's pin cap.
    """
    gpu = replica_gpu(memory)
    lease = pin_cap_bytes(memory) if host_lease_bytes is None else min(host_lease_bytes, pin_cap_bytes(memory))
    return PipelineFacts(tuple(components), tuple(stages),
                         memory.device_budget.capacity() if device_capacity is None else device_capacity,
                         link or link_facts(gpu=gpu), lease, working_set_bytes,
                         gpu.name if gpu else str(memory.device))


def plan_for_replica(profile: FleetProfile, facts: PipelineFacts, mode: PerformanceMode | None = None,
                     owner: str = "replica") -> PipelinePlan:
    """Plan in ``mode`` (None: the profile's), within the profile's prefetch depth and resident-fraction limit."""
    mode = mode or profile.performance_mode()
    overrides = {c.name: ComponentOverride(prefetch_depth=profile.prefetch_depth) for c in facts.components if c.layers}
    plan = plan_pipeline(facts, mode, overrides)
    capped = {}
    for c in plan.components:
        limit = math.floor(profile.max_resident_fraction * len(facts.component(c.name).layers))
        if c.strategy is Strategy.LAYERWISE and c.resident_layers > limit:
            capped[c.name] = dataclasses.replace(overrides[c.name], resident_layers=limit)
    if capped:
        plan = plan_pipeline(facts, mode, {**overrides, **capped})
    logger.info("%s: plan on %s (profile %s, mode %s, depth %d): %s; peak %.2f GB of %.2f GB, %.2f GB moved per "
                "request%s", owner, facts.device_name, profile.name, mode.value, profile.prefetch_depth,
                ", ".join(f"{c.name}={c.strategy.value}" for c in plan.components), plan.peak_device_bytes / GB,
                facts.device_capacity / GB, plan.bytes_moved_per_request / GB,
                f"; resident layers capped at {profile.max_resident_fraction:.0%} for {sorted(capped)}" if capped else "")
    return plan
