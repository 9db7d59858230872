"""A replica's plan from what it sees: its GPU's pool, its PCIe link, its host lease, its profile.

The one entry a stage replica plans through: :func:`plan_stage` before anything ran (0 s of compute,
no working set) and :func:`replan_stage` after its warm-up, or after a component's first use, with
measured compute and a working set; both in the replica's fleet profile and ledger view. The planner
itself (facts, search, plan, picture) is ``offload_core.planner``.

The same pipeline facts give a 12 GB replica a streamed plan and an 80 GB one a resident plan,
chosen from the GPU the replica sees (its fleet profile, configs/fleet/fleet.yaml): the mode when
the stage's configuration leaves it to the fleet, and always the profile's limits (prefetch depth,
the most resident layers, the most host memory one replica may pin). Run by every stage replica
(and each tensor-parallel rank) of the service.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import os
from typing import TYPE_CHECKING, Mapping, Sequence

from cluster.fleet import FleetProfile
from cluster.node import GB, GpuInfo
from cluster.replica.ledger_view import ReplicaMemory
from offload_core.host.budget import MemoryBudget
from offload_core.planner.facts import ComponentProfile, LinkFacts, PipelineFacts, Stage, profile_component
from offload_core.planner.gpus import link_Bps
from offload_core.planner.measured_compute import MeasuredCompute, with_measured_compute
from offload_core.planner.search import (
    ComponentOverride,
    PerformanceMode,
    PipelinePlan,
    memory_floor_bytes,
    plan_pipeline,
)
from offload_core.planner.strategy import Strategy
from offload_core.quant import WeightFormat
from offload_core.streaming.fill_threads import default_cap, usable_cpus
from offload_core.streaming.link import is_measured, measure_link, probe_host_bytes
from offload_core.tables import HostTablesConfig

if TYPE_CHECKING:
    import torch
    from torch import nn

logger = logging.getLogger(__name__)


def link_facts(device: "torch.device | None" = None, gpu: GpuInfo | None = None,
               copier_cap: int | None = None) -> LinkFacts:
    """The replica's link to its device: measured on CUDA (staged fills split over at most ``copier_cap``
    threads, :func:`copier_cap`); elsewhere (nothing to measure) the GPU table's bandwidths for the
    link ``gpu`` reports, or the table's default link without one."""
    if device is not None and device.type == "cuda":
        return measure_link(device, copier_cap=copier_cap)
    pinned, pageable = link_Bps(gpu.pcie_gen if gpu else None, gpu.pcie_width if gpu else None)
    return LinkFacts(pinned, pageable, measured=False)


# A neighbour's probes hold their bytes ~1-2 s at its start: a replica starting beside it waits that out
# (the ledger serves waiting requests as bytes are given back).
PROBE_WAIT_S = 10.0


def measured_link(memory: ReplicaMemory, device: "torch.device") -> LinkFacts:
    """The replica's CUDA link measured with its probes' host memory (up to 1.06 GiB, ``probe_host_bytes``)
    leased from the node's host pool while they run, so replicas starting together never take more host
    memory than the node has; where the pool cannot give it within ``PROBE_WAIT_S``, the GPU table's link."""
    cap = copier_cap(memory)
    if is_measured(device, cap):
        return measure_link(device, copier_cap=cap)
    nbytes = probe_host_bytes()
    lease = _probe_lease(memory, nbytes)
    if lease is None:
        return link_facts(gpu=replica_gpu(memory))
    try:
        return measure_link(device, copier_cap=cap)
    finally:
        memory.host_budget.release(lease)


def _probe_lease(memory: ReplicaMemory, nbytes: int):
    lease = memory.host_budget.acquire(nbytes, memory.owner, purpose="link probe", wait_s=PROBE_WAIT_S)
    if not lease:
        logger.info("%s: link not measured: its probes need %.2f GB of host memory for ~1-2 s and the node's "
                    "host pool had %.2f GB free after %.0f s (%s); the GPU table's link figures are planned with",
                    memory.owner, nbytes / GB, lease.available / GB, PROBE_WAIT_S, lease.reason)
        return None
    return lease


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


def replica_gpu(memory: ReplicaMemory) -> GpuInfo | None:
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


def process_note(link: LinkFacts) -> str:
    """What Ray gave this process and what the engine chose, for the plan's explanation: Ray starts
    workers at niceness 15 unless told otherwise (the service asks for ``AppArgs.replica_niceness``,
    0 by default) and sets OMP_NUM_THREADS to an actor's num_cpus (1 when unset), which bounds the
    threads compute launches from; the staging fills use the copier's own threads instead (on the
    H200, one thread filled at 5.4 GB/s where memcpy reached 28.6)."""
    import torch

    return (f"process: nice {os.nice(0)}, {torch.get_num_threads()} intra-op thread(s) for compute "
            f"(OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}, as Ray set it); the engine's staging "
            f"fills split over {link.copier_threads} copier thread(s) of their own")


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
    process = process_note(facts.link)
    plan = dataclasses.replace(plan, notes=(*plan.notes, process))
    logger.info("%s: plan on %s (profile %s, mode %s, depth %d): %s; peak %.2f GB of %.2f GB, %.2f GB moved per "
                "request%s; %s", owner, facts.device_name, profile.name, mode.value, profile.prefetch_depth,
                ", ".join(f"{c.name}={c.strategy.value}" for c in plan.components), plan.peak_device_bytes / GB,
                facts.device_capacity / GB, plan.bytes_moved_per_request / GB,
                f"; resident layers capped at {profile.max_resident_fraction:.0%} for {sorted(capped)}" if capped else "",
                process)
    return plan


def stage_phases(stage: str, components: Mapping[str, nn.Module],
                 phases: Sequence[Sequence[str]] | None) -> tuple[Stage, ...]:
    """The planner's stages for one stage replica: the whole stage, or one per phase when only one
    phase's components run at a time (Wan2.2 A14B's experts: ``denoise:transformer``, then
    ``denoise:transformer_2``), so the plan holds one phase's working set with the others idle."""
    if not phases or len(phases) < 2:
        return (Stage(stage, tuple(components)),)
    return tuple(Stage(f"{stage}:{names[0]}", tuple(names)) for names in phases)


def plan_stage(stage: str, components: Mapping[str, nn.Module], uses_per_request: Mapping[str, int],
               mode: PerformanceMode | None, device: torch.device, device_capacity: int, host_lease_bytes: int,
               memory: ReplicaMemory | None = None, expected_batch: float = 1.0,
               phases: Sequence[Sequence[str]] | None = None,
               weights: WeightFormat = WeightFormat.NATIVE,
               tables: HostTablesConfig = HostTablesConfig()) -> PipelinePlan:
    """The plan for one stage's components: this replica's whole "pipeline" is its stage.

    With the replica's ``memory`` (the service always has it) the plan is the fleet profile's for
    the GPU the replica got (``cluster.replica.plan``): its mode when ``mode`` is None, its limits
    always. Without it, ``plan_pipeline`` in ``mode`` and nothing else. ``expected_batch``: requests
    expected to share each use (the Denoiser's configured batch maximum): bytes moved per request
    are the stream's bytes divided by it. Compute is 0 s and no working set is kept until the
    warm-up measured them (:func:`replan_stage`).
    """
    profiles = tuple(dataclasses.replace(profile_component(name, module, uses_per_request=uses_per_request[name],
                                                           weights=weights, tables=tables),
                                         expected_batch=expected_batch)
                     for name, module in components.items())
    stages = stage_phases(stage, components, phases)
    if memory is None:
        if mode is None:
            raise ValueError(f"stage {stage}: no offload mode and no replica memory to take a fleet profile from")
        facts = PipelineFacts(components=profiles, stages=stages, device_capacity=device_capacity,
                              link=link_facts(device), host_lease_bytes=host_lease_bytes, device_name=str(device))
        return plan_pipeline(facts, mode)
    # On CUDA the link is measured; elsewhere the GPU table's link for the GPU the replica leases.
    link = measured_link(memory, device) if device.type == "cuda" else None
    facts = replica_facts(memory, profiles, stages, device_capacity=device_capacity, link=link,
                          host_lease_bytes=host_lease_bytes)
    return plan_for_replica(memory.profile, facts, mode, owner=memory.owner)


def replan_stage(planned: PipelinePlan, memory: ReplicaMemory | None, *, compute: Mapping[str, MeasuredCompute],
                 working_set_bytes: int) -> PipelinePlan:
    """``planned`` made again from its own facts with measured ``compute`` per use of each component and
    ``working_set_bytes`` kept free of weights (at most what leaves the leanest plan room), in its mode.

    The facts are the first plan's, not read again from the modules: applied, a streamed layer's
    parameters are placeholders, and a profile read from them would have no bytes.
    """
    if planned.facts is None:
        raise ValueError("the plan carries no facts to plan again from: make it with plan_stage")
    facts = dataclasses.replace(planned.facts, components=tuple(
        with_measured_compute(profile, compute[profile.name]) for profile in planned.facts.components))
    if memory is None:
        return plan_pipeline(_with_working_set(facts, working_set_bytes), planned.mode)
    depth = {p.name: ComponentOverride(prefetch_depth=memory.profile.prefetch_depth) for p in facts.components
             if p.layers}
    return plan_for_replica(memory.profile, _with_working_set(facts, working_set_bytes, depth), planned.mode,
                            owner=memory.owner)


def _with_working_set(facts: PipelineFacts, nbytes: int, overrides=None) -> PipelineFacts:
    """``facts`` keeping ``nbytes`` for activations, capped so the leanest plan's weights still fit."""
    room = max(0, facts.device_capacity - memory_floor_bytes(facts, overrides))
    return dataclasses.replace(facts, working_set_bytes=min(max(0, nbytes), room))


def host_lease_bytes(host_budget: MemoryBudget, host_budget_bytes: int | None) -> int:
    """The replica plans within min(its own budget, what the node ledger has free)."""
    free = host_budget.available()
    return free if host_budget_bytes is None else min(free, host_budget_bytes)
