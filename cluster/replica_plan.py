"""A replica's plan from what it sees: its GPU's pool, its PCIe link, its host lease, its profile.

The same pipeline facts give a 12 GB replica a streamed plan and an 80 GB one a resident plan,
chosen from the GPU the replica sees (its fleet profile), never from a hand-set flag.
"""
from __future__ import annotations

import dataclasses
import logging
import math
from typing import Sequence

from cluster.node import GB, GpuFacts
from cluster.replica_memory import ReplicaMemory
from offload_core.planner.facts import ComponentProfile, LinkFacts, PipelineFacts, Stage
from offload_core.planner.gpus import link_Bps
from offload_core.planner.search import (
    ComponentOverride,
    PerformanceMode,
    plan_pipeline,
)
from offload_core.planner.strategy import Strategy

logger = logging.getLogger(__name__)

def link_facts(gpu: GpuFacts | None) -> LinkFacts:
    """The GPU table's bandwidths for the link this GPU reports (none known: the table's default link)."""
    pinned, pageable = link_Bps(gpu.pcie_gen if gpu else None, gpu.pcie_width if gpu else None)
    return LinkFacts(pinned, pageable, measured=False)


def replica_facts(memory: ReplicaMemory, components: Sequence[ComponentProfile], stages: Sequence[Stage],
                  working_set_bytes: int = 0) -> PipelineFacts:
    """Pipeline facts for this replica: device capacity = its GPU pool, host lease = its cap."""
    gpu = next((g for g in memory.node.gpus if f"gpu:{g.index}" == memory.device_pool), None)
    host_lease = int(memory.node.ram.spendable * memory.profile.host_pin_cap_fraction)
    return PipelineFacts(tuple(components), tuple(stages), memory.device_budget.capacity(), link_facts(gpu),
                         host_lease, working_set_bytes, gpu.name if gpu else str(memory.device))


def plan_for_replica(memory: ReplicaMemory, components: Sequence[ComponentProfile], stages: Sequence[Stage],
                     working_set_bytes: int = 0, mode: PerformanceMode | None = None):
    """Plan in the profile's mode (or ``mode``), with its prefetch depth and resident-fraction limit."""
    profile = memory.profile
    mode = mode or profile.performance_mode()
    facts = replica_facts(memory, components, stages, working_set_bytes)
    overrides = {c.name: ComponentOverride(prefetch_depth=profile.prefetch_depth) for c in components if c.layers}
    plan = plan_pipeline(facts, mode, overrides)
    capped = {}
    for c in plan.components:
        limit = math.floor(profile.max_resident_fraction * len(facts.component(c.name).layers))
        if c.strategy is Strategy.LAYERWISE and c.resident_layers > limit:
            capped[c.name] = dataclasses.replace(overrides[c.name], resident_layers=limit)
    if capped:
        plan = plan_pipeline(facts, mode, {**overrides, **capped})
    logger.info("%s: plan on %s (profile %s, mode %s): %s; peak %.2f GB of %.2f GB, %.2f GB moved per request%s",
                memory.owner, facts.device_name, profile.name, mode.value,
                ", ".join(f"{c.name}={c.strategy.value}" for c in plan.components), plan.peak_device_bytes / GB,
                facts.device_capacity / GB, plan.bytes_moved_per_request / GB,
                f"; resident layers capped at {profile.max_resident_fraction:.0%} for {sorted(capped)}" if capped else "")
    return plan
