"""The host side of applying a plan: the plan's tiers fitted to the host budget, within the replica's own.

``host_leases`` runs ``offload_core.host.hosting.plan_hosting`` for the plan's streamed components
(one lease for their net anonymous cost) inside the replica's ``host_memory_budget`` when one is
set, and returns the plan with any tiers the host changed, said in its notes and the log.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Mapping

import torch
from torch import nn

from offload_core.buffers import staging_bytes
from offload_core.host.budget import MemoryBudget
from offload_core.host.budget_cap import BudgetTooSmall, CappedBudget
from offload_core.host.tier import HostingTier
from offload_core.planner.pipeline_plan import PipelinePlan
from offload_core.planner.search import retier
from offload_core.planner.strategy import Strategy

logger = logging.getLogger(__name__)


def host_leases(plan: PipelinePlan, components: Mapping[str, nn.Module], budget: MemoryBudget | None,
                owner: str, host_budget_bytes: int | None = None, shared=None, device: torch.device | None = None):
    """Fit the plan's tiers to the host budget with ``hosting.plan_hosting`` (one lease, net cost).

    The plan's tiers are ceilings; node stores and the host-memory plan may change them (shared
    copies come as the store made them; pageable mapped -> MAPPED, then pins given back, when the
    node is short). Tiers that change are applied, said in the plan's notes and the log, and the
    plan is re-predicted from its facts (``search.retier``): the plan returned, the one the report
    shows, is the one that runs.
    """
    from offload_core.host.hosting import HostingPolicy, plan_hosting
    from offload_core.host.on_host import layers_on_host

    planned = plan
    plan, shared_hosts = _shared(plan, components, shared, device)
    streamed = [c for c in plan.components if c.strategy is Strategy.LAYERWISE and c.name not in shared_hosts]
    if budget is None or not streamed:
        return _repredicted(planned, plan), None, budget, shared_hosts
    facts = [layers_on_host(c.name, components[c.name], c.layer_groups or None, c.uses_per_request,
                               resident_keys=[key for key, _ in c.hosting[:c.resident_layers]],
                               layer_order=[key for key, _ in c.hosting], weights=c.weights) for c in streamed]
    if host_budget_bytes is not None:
        budget = _capped(budget, facts, streamed, owner, host_budget_bytes)
    # The plan's tiers are the ceilings: the host may only lower them.
    # The plan's tiers are the ceilings, its staging rings too: the host may only lower them.
    policy = HostingPolicy(wanted={c.name: dict(c.hosting) for c in streamed},
                           staging={c.name: c.staging_buffers for c in streamed})
    hosting = plan_hosting(facts, budget, owner, policy)
    changed, components_ = [], []
    for c in plan.components:
        if c.strategy is Strategy.LAYERWISE and c.name not in shared_hosts:
            tiers = hosting.tiers_for(c.name)
            moved = [key for key, tier in c.hosting if tiers[key] is not tier]
            if moved:
                changed.append(f"{c.name}: {len(moved)} layers re-tiered by the host budget ({hosting.component(c.name).reason})")
                c = dataclasses.replace(c, hosting=tuple((key, tiers[key]) for key, _ in c.hosting))
            buffers = hosting.component(c.name).staging_buffers
            if buffers < c.staging_buffers:
                changed.append(f"{c.name}: staging ring narrowed from {c.staging_buffers} to {buffers} buffers by the "
                               f"host budget ({'; '.join(hosting.reasons) or 'host short'})")
                c = dataclasses.replace(c, staging_buffers=buffers,
                                        staging_why=f"{c.staging_why}; narrowed to {buffers} by the host budget")
        components_.append(c)
    for line in changed:
        logger.info("residency %s: %s", owner, line)
    plan = dataclasses.replace(plan, components=tuple(components_), notes=(*plan.notes, *changed))
    return _repredicted(planned, plan), hosting, budget, shared_hosts


def _repredicted(planned: PipelinePlan, plan: PipelinePlan) -> PipelinePlan:
    """``plan`` (``planned`` with tiers changed) with every prediction recomputed, if any tier changed."""
    if [(c.hosting, c.staging_buffers) for c in plan.components] == [(c.hosting, c.staging_buffers)
                                                                     for c in planned.components]:
        return plan
    buffers = {c.name: c.staging_buffers for c in plan.components}
    planned = dataclasses.replace(planned, components=tuple(
        dataclasses.replace(c, staging_buffers=buffers[c.name]) for c in planned.components))
    return retier(planned, {c.name: dict(c.hosting) for c in plan.components}, plan.notes[len(planned.notes):])


def _shared(plan: PipelinePlan, components: Mapping[str, nn.Module], shared, device):
    """Streamed components hosted from node stores (``SharedWeights``), their tiers as the stores gave them.

    A component with a layer planned MAPPED stays private: MAPPED means "copy nothing", which a
    private plan honours and a store would not.
    """
    hosts: dict = {}
    if shared is None:
        return plan, hosts
    updated = []
    for c in plan.components:
        wants_copy = HostingTier.MAPPED not in dict(c.hosting).values()
        if c.strategy is Strategy.LAYERWISE and shared.covers(c.name) and wants_copy:
            got = shared.host_layers(c.name, components[c.name], c.layer_groups or None, dict(c.hosting), device,
                                     c.weights)
            if got is not None:
                hosts[c.name] = got
                c = dataclasses.replace(c, hosting=tuple((key, got[key].tier) for key, _ in c.hosting))
        updated.append(c)
    return dataclasses.replace(plan, components=tuple(updated)), hosts


def _capped(budget: MemoryBudget, facts, streamed, owner: str, host_budget_bytes: int) -> CappedBudget:
    """The node budget within this replica's own: what its layers already hold in anonymous memory counts first.

    Layers a converting dtype copied out of the file mapping are anonymous whatever the plan (a
    MAPPED layer keeps them as they are; consolidating them is a wash), so they are the floor. On
    top, each component's cheapest hosting: every layer left as it is plus the pinned staging
    buffers they are then copied through, or (when the plan lets every layer be pinned) every
    layer consolidated, if that costs less (anonymous layers cost only their padding). That part
    is leased through the plan, so only the anonymous layers come off the cap.
    """
    floor = sum(layer.anon_bytes for c in facts for layer in c.layers)
    staging = 0
    for component, plan in zip(facts, streamed):
        stage_all = staging_bytes(layer.layout_bytes for layer in component.layers)
        all_pinnable = all(tier is HostingTier.PINNED for _, tier in plan.hosting)
        pin_all = sum(layer.consolidation_cost for layer in component.layers)
        if any(layer.quantized for layer in component.layers):  # FP8 layers are consolidated whatever the tier
            staging += pin_all + (0 if all_pinnable else stage_all)
            continue
        staging += min(stage_all, pin_all) if all_pinnable else stage_all
    if floor + staging > host_budget_bytes:
        raise BudgetTooSmall(owner, host_budget_bytes, floor + staging,
                             f"{floor} B of its streamed layers are already anonymous host memory (loaded with a "
                             f"converting dtype) and {staging} B of pinned staging buffers carry the layers left "
                             "in pageable or mapped memory, and no plan holds less")
    logger.info("residency %s: host budget %d B, %d B of it already held by anonymous layer weights, so "
                "tiers fit within min(%d B, what the node grants)", owner, host_budget_bytes, floor,
                host_budget_bytes - floor)
    return CappedBudget(budget, host_budget_bytes - floor, f"{owner} host_memory_budget")


def tiers_as_hosted(plan: PipelinePlan, streamers: Mapping[str, object]) -> PipelinePlan:
    """The plan with each streamed layer's tier as the engine hosted it (``streamers``: name -> LayerStreamer).

    A layer planned PINNED whose pages the driver refused to lock (a memlock limit) is PAGEABLE:
    the plan says so, with a note, and is re-predicted (``search.retier``), so the report, the
    board and the plan agree with the engine. Refused staging buffers (the layers then copy
    unstaged) are a note too.
    """
    notes, components = [], []
    for c in plan.components:
        if c.strategy is Strategy.LAYERWISE and c.name in streamers:
            hosted = {layer.key: layer.tier for layer in streamers[c.name].layers}
            moved = [key for key, tier in c.hosting if hosted[key] is not tier]
            if moved:
                notes.append(f"{c.name}: {len(moved)} layers PAGEABLE instead of PINNED, the driver refused to "
                             f"lock them ({', '.join(moved[:4])}{'...' if len(moved) > 4 else ''})")
                c = dataclasses.replace(c, hosting=tuple((key, hosted[key]) for key, _ in c.hosting))
            staging = getattr(streamers[c.name], "staging", None)
            if staging is not None and staging.refusal is not None:
                notes.append(f"{c.name}: staging buffers not pinned ({staging.refusal.explain()}); its "
                             f"PAGEABLE/MAPPED layers are copied unstaged, each copy blocking the launch thread")
        components.append(c)
    for line in notes:
        logger.info("residency: %s", line)
    if not notes:
        return plan
    # Re-predicted: a pageable copy is synchronous, so the time per request changes with the tier.
    return retier(plan, {c.name: dict(c.hosting) for c in components}, notes)
