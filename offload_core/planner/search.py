"""The planner: performance modes and the search that turns facts into one explainable plan.

``plan_pipeline(facts, mode)``:
- SPEED: every component resident.
- MEMORY: every streamable component layerwise with nothing resident, parked between uses, its
  big token tables on the host; components without layer groups are model-offloaded.
- AUTO (default): the fastest plan that fits ``facts.weight_budget``. Every combination of
  per-component strategies is considered, best lower bound first, and tried unless its bound proves
  it slower than the best plan found (``planner.search_bound``: the exhaustive search's result, with
  a few of the hundreds of combinations tried); in each, resident layers are added greedily (best time
  saved per device byte first) while streaming is not yet hidden behind compute, and stop at
  the first addition that no longer fits. The greedy path does not depend on the capacity, so
  a bigger device only ever extends it: more memory never plans slower. Then each streamed
  component's prefetch window is widened to the least depth that stays ahead of its layers
  (``planner.window.choose_window``: depth 1 for equal layers; more for an uneven stack such
  as FLUX's double then single blocks), or as wide towards it as still fits; and its staging ring
  (PAGEABLE/MAPPED layers) to ``planner.staging_ring.choose_staging``'s buffers where the host
  lease has the bytes beside the pins, else the default two, said in the plan.
- BALANCED: the fastest plan within max(half the weight budget, the memory plan's peak).
Ties go to fewer bytes moved, then to the smaller peak. Overrides pin any field by hand.

Runs in whichever process plans: ``offload-serve plan`` and each stage replica (through ``cluster/replica/plan.py``).
"""
from __future__ import annotations

import dataclasses
import itertools
import logging
from typing import Mapping, Sequence

from offload_core.buffers import DEFAULT_STAGING_BUFFERS
from offload_core.host.tier import HostingTier
from offload_core.planner import host_tiers
from offload_core.planner.cost_model import non_layer_device_bytes, predict
from offload_core.planner.facts import ComponentProfile, PipelineFacts
from offload_core.planner.pipeline_plan import (  # noqa: F401 (re-exported)
    ComponentOverride,
    ComponentPlan,
    PerformanceMode,
    PipelinePlan,
)
from offload_core.planner.search_bound import (
    MARGIN_S,
    combination_time_bound,
    component_bounds,
    fillable,
    pin_room,
)
from offload_core.planner.staging_ring import choose_staging
from offload_core.planner.strategy import Strategy
from offload_core.planner.window import choose_window

logger = logging.getLogger(__name__)

# BALANCED keeps weights within half the device: the other half holds activations of larger
# requests (a 720p Wan2.1 step needs several GiB) or a neighbour replica on a shared GPU.
BALANCED_FRACTION = 0.5
# Gate predictions converge in two rounds for pipelines of one component per stage; a gate that
# flips back and forth (parking A frees room so B no longer parks) is settled by the last round.
_GATE_ROUNDS = 4


def _base(profile: ComponentProfile, strategy: Strategy, park: bool, tables: bool) -> ComponentPlan:
    return ComponentPlan(profile.name, strategy, profile.layer_groups, 0, 1, park, tables, (),
                         uses_per_request=max(1, profile.uses_per_request),
                         weights=profile.weights)


def _options(profile: ComponentProfile, override: ComponentOverride) -> list[ComponentPlan]:
    """The strategy combinations worth trying for one component (overrides applied)."""
    tables = (False, True) if profile.table_bytes else (False,)
    opts = [_base(profile, Strategy.RESIDENT, False, t) for t in tables]
    opts += [_base(profile, Strategy.MODEL_OFFLOAD, False, t) for t in tables]
    if profile.layers:
        opts += [_base(profile, Strategy.LAYERWISE, park, t) for park in (False, True) for t in tables]
    pinned = [_override(o, override) for o in opts]
    return list({(o.strategy, o.park, o.host_tables, o.resident_layers, o.prefetch_depth): o
                 for o in pinned}.values())


def _override(plan: ComponentPlan, o: ComponentOverride) -> ComponentPlan:
    fields = {k: v for k, v in dataclasses.asdict(o).items() if v is not None and k != "hosting"}
    return dataclasses.replace(plan, **fields)


def _predict(profile, plan, link, parked: bool, cache: dict | None):
    """``predict``, memoized within one search (the greedy re-evaluates unchanged components often)."""
    if cache is None:
        return predict(profile, plan, link, parked)
    key = (profile.name, plan, parked)
    if key not in cache:
        cache[key] = predict(profile, plan, link, parked)
    return cache[key]


def _gates(facts: PipelineFacts, plans: dict[str, ComponentPlan], preds: dict) -> dict[str, bool]:
    """Predict the parking gate of each component, as the residency runs it at ``finish_use``.

    At a stage's end its components' layers are released first; then, in stage order, each
    gated component parks iff its non-layer bytes exceed ``park_fraction`` of the headroom left:
    capacity minus the other stages' idle bytes, its stage's non-layer bytes, and minus what the
    stage's earlier components just parked.
    """
    parked = {}
    for stage in facts.stages:
        current = sum(preds[n].idle_bytes for n in plans if n not in stage.components)
        # Layers released, model-offloaded components gone: what stays is non-layer bytes and residents.
        current += sum(non_layer_device_bytes(facts.component(n), plans[n])
                       if plans[n].strategy is Strategy.LAYERWISE else preds[n].idle_bytes for n in stage.components)
        for name in stage.components:
            nbytes = non_layer_device_bytes(facts.component(name), plans[name])
            gate = (plans[name].strategy is Strategy.LAYERWISE and plans[name].park and nbytes > 0
                    and nbytes > facts.park_fraction * (facts.device_capacity - current))
            parked[name] = gate
            current -= nbytes if gate else 0
    return parked


def _predict_all(facts: PipelineFacts, plans: dict[str, ComponentPlan], cache: dict | None) -> dict[str, ComponentPlan]:
    """The plans with their predictions, the gates predicted: iterated to a fixed point (the steady
    state of requests). Memoized per (plan, gate) within one search, as :func:`_predict` is: a search
    builds the same predicted plan tens of thousands of times (310 k copies planning SD3.5-Large)."""
    parked = {n: p.park for n, p in plans.items()}
    for _ in range(_GATE_ROUNDS):
        preds = {p.name: _predict(p, plans[p.name], facts.link, parked[p.name], cache) for p in facts.components}
        settled = _gates(facts, plans, preds)
        if settled == parked:
            break
        parked = settled
    if cache is None:
        return {n: dataclasses.replace(plans[n], prediction=preds[n]) for n in plans}
    done = {}
    for n, plan in plans.items():
        key = ("predicted", n, plan, parked[n])
        if key not in cache:
            cache[key] = dataclasses.replace(plan, prediction=preds[n])
        done[n] = cache[key]
    return done


def _evaluate(facts: PipelineFacts, mode: PerformanceMode, plans: dict[str, ComponentPlan],
              overrides: Mapping[str, ComponentOverride], budget: int, cache: dict | None = None,
              assign_hosting: bool = True) -> PipelinePlan:
    if assign_hosting:
        plans = host_tiers.assign_hosting(facts, plans, overrides, cache)
    done = _predict_all(facts, plans, cache)
    peak, peak_stage = -1, ""
    for stage in facts.stages:
        bytes_ = sum(done[n].prediction.in_use_bytes if n in stage.components else done[n].prediction.idle_bytes
                     for n in done)
        if bytes_ > peak:
            peak, peak_stage = bytes_, stage.name
    pinned = sum(host_tiers.pinned_bytes(facts.component(n), c.hosting, cache) for n, c in done.items())
    preds = [c.prediction for c in done.values()]
    staging = sum(p.staging_bytes for p in preds)
    return PipelinePlan(
        mode=mode, components=tuple(done[p.name] for p in facts.components), stages=facts.stages,
        device_name=facts.device_name, device_capacity=facts.device_capacity, weight_budget=budget,
        peak_device_bytes=peak, peak_stage=peak_stage,
        bytes_moved_per_request=sum(p.bytes_moved for p in preds),
        transfer_s_per_request=sum(p.transfer_s for p in preds),
        compute_s_per_request=sum(p.compute_s for p in preds),
        time_s_per_request=sum(p.time_s for p in preds), pinned_bytes=pinned + staging,
        feasible=peak <= budget, park_fraction=facts.park_fraction, facts=facts, staging_bytes=staging)


def _fill_residents(facts: PipelineFacts, mode: PerformanceMode, plans: dict[str, ComponentPlan],
                    overrides: Mapping[str, ComponentOverride], budget: int, cache: dict) -> PipelinePlan:
    """Add resident layers, best time saved per device byte first, until hidden or out of room."""
    current = _evaluate(facts, mode, plans, overrides, budget, cache)
    open_ = [p for p in facts.components if plans[p.name].strategy is Strategy.LAYERWISE and fillable(p, overrides)]
    while open_:
        best = None
        for profile in open_:
            plan = plans[profile.name]
            if plan.resident_layers >= len(profile.layers):
                continue
            trial = _evaluate(facts, mode, {**plans, profile.name: dataclasses.replace(
                plan, resident_layers=plan.resident_layers + 1)}, overrides, budget, cache)
            gain = current.time_s_per_request - trial.time_s_per_request
            cost = max(trial.peak_device_bytes - current.peak_device_bytes, 1)
            if gain > 1e-12 and (best is None or gain / cost > best[0]):
                best = (gain / cost, profile.name, trial)
        if best is None or not best[2].feasible:
            break
        plans = {**plans, best[1]: best[2].component(best[1])}
        current = best[2]
    return current


def _fit_windows(facts: PipelineFacts, mode: PerformanceMode, current: PipelinePlan,
                 overrides: Mapping[str, ComponentOverride], budget: int, cache: dict) -> PipelinePlan:
    """Each streamed component's window widened to the depth that stays ahead of its layers, or the
    widest towards it that fits and is faster (a depth pinned by an override is kept)."""
    plans = {c.name: dataclasses.replace(c, prediction=None) for c in current.components}
    for profile in facts.components:
        plan = plans[profile.name]
        if plan.strategy is not Strategy.LAYERWISE:
            continue
        if overrides.get(profile.name, ComponentOverride()).prefetch_depth is None:
            current, plans = _widen_window(facts, mode, current, plans, profile, overrides, budget, cache)
        current, plans = _size_staging(facts, mode, current, plans, profile, overrides, budget, cache)
    return current


def _widen_window(facts, mode, current, plans, profile, overrides, budget, cache):
    """``profile``'s window widened to ``choose_window``'s depth, or the widest towards it that fits and is faster."""
    plan = plans[profile.name]
    r = min(plan.resident_layers, len(profile.layers))
    choice = choose_window(profile.layers[r:], dict(plan.hosting), facts.link, profile.compute_s_per_layer[r:],
                           profile.compute_s_rest)
    for depth in range(choice.depth, plan.prefetch_depth, -1):
        trial = _evaluate(facts, mode, {**plans, profile.name: dataclasses.replace(plan, prefetch_depth=depth)},
                          overrides, budget, cache)
        if trial.feasible and _key(trial) < _key(current):
            logger.debug("plan: %s window depth %d (%d B): %.4f s per use beyond the bound at depth 1",
                         profile.name, depth, choice.window_bytes, choice.shallow_wait_s)
            current, plans[profile.name] = trial, dataclasses.replace(plan, prefetch_depth=depth)
            break
    return current, plans


def _size_staging(facts, mode, current, plans, profile, overrides, budget, cache):
    """``profile``'s staging ring sized by ``choose_staging`` at its window's depth, if the host lease
    has the bytes beside every pin (pins first: a pinned layer needs no staging at all); otherwise
    the default ring, said in the plan."""
    plan = plans[profile.name]
    r = min(plan.resident_layers, len(profile.layers))
    choice = choose_staging(profile.layers[r:], dict(plan.hosting), facts.link, profile.compute_s_per_layer[r:],
                            plan.prefetch_depth, profile.compute_s_rest)
    if choice is None:
        return current, plans
    if choice.buffers <= DEFAULT_STAGING_BUFFERS:
        plans[profile.name] = dataclasses.replace(plan, staging_why=f"{choice.explain()}: enough")
        return _with(current, plans[profile.name]), plans
    wide = dataclasses.replace(plan, staging_buffers=choice.buffers)
    trial = _evaluate(facts, mode, {**plans, profile.name: wide}, overrides, budget, cache)
    room = facts.host_lease_bytes - current.pinned_bytes
    extra = trial.pinned_bytes - current.pinned_bytes
    if extra <= room:
        why = (f"{choice.explain()}: {choice.buffers} buffers for its uneven layers, "
               f"{extra / 2**30:.2f} GiB more pinned of the {room / 2**30:.2f} GiB the lease had left")
        plans[profile.name] = dataclasses.replace(wide, staging_why=why)
        logger.info("plan: %s %s", profile.name, why)
        return _with(trial, plans[profile.name]), plans
    why = (f"{choice.explain()}: kept at {DEFAULT_STAGING_BUFFERS} buffers, the host lease is short "
           f"({choice.buffers} would pin {extra / 2**30:.2f} GiB more, {room / 2**30:.2f} GiB left beside the pins)")
    plans[profile.name] = dataclasses.replace(plan, staging_why=why)
    logger.info("plan: %s %s", profile.name, why)
    return _with(current, plans[profile.name]), plans


def _with(current: PipelinePlan, decided: ComponentPlan) -> PipelinePlan:
    """``current`` with ``decided``'s staging decision (its buffers were priced in ``current`` already)."""
    return dataclasses.replace(current, components=tuple(
        dataclasses.replace(c, staging_buffers=decided.staging_buffers, staging_why=decided.staging_why)
        if c.name == decided.name else c for c in current.components))

def _key(plan: PipelinePlan):
    # Equal predicted times: fewer bytes moved first (the compute estimate is a floor, so a plan
    # that copies less is the safer bet, and host memory bandwidth is shared), then the smaller peak.
    return (not plan.feasible, round(plan.time_s_per_request, 9), plan.bytes_moved_per_request, plan.peak_device_bytes)


def _fixed(facts: PipelineFacts, mode: PerformanceMode, overrides, budget: int) -> PipelinePlan:
    plans = {}
    for p in facts.components:
        if mode is PerformanceMode.SPEED:
            plan = _base(p, Strategy.RESIDENT, False, False)
        elif p.layers:
            plan = _base(p, Strategy.LAYERWISE, True, bool(p.table_bytes))
        else:
            plan = _base(p, Strategy.MODEL_OFFLOAD, False, bool(p.table_bytes))
        plans[p.name] = _override(plan, overrides.get(p.name, ComponentOverride()))
    return _evaluate(facts, mode, plans, overrides, budget)


def _search(facts: PipelineFacts, mode: PerformanceMode, overrides, budget: int) -> PipelinePlan:
    """The best of every strategy combination, as if each were tried in ``itertools.product`` order (the
    first of equal keys wins), but best bound first (``planner.search_bound``): a combination whose bound
    is above the best feasible plan's time cannot win, nor can any after it, so the search stops there."""
    options = [_options(p, overrides.get(p.name, ComponentOverride())) for p in facts.components]
    bounds = [component_bounds(p, opts, facts.link, fillable(p, overrides), pin_room(facts, p, overrides))
              for p, opts in zip(facts.components, options)]
    combos = sorted((combination_time_bound(facts, [bounds[c][i] for c, i in enumerate(picks)], budget), order, picks)
                    for order, picks in enumerate(itertools.product(*(range(len(o)) for o in options))))
    best, best_rank, cache, tried = None, None, {}, 0
    for bound, order, picks in combos:
        if best is not None and best.feasible and bound > best.time_s_per_request + MARGIN_S:
            break
        plans = {p.name: options[c][i] for c, (p, i) in enumerate(zip(facts.components, picks))}
        candidate = _fit_windows(facts, mode, _fill_residents(facts, mode, plans, overrides, budget, cache),
                                 overrides, budget, cache)
        tried += 1
        if best is None or (_key(candidate), order) < best_rank:
            best, best_rank = candidate, (_key(candidate), order)
    logger.debug("plan search: %d of %d strategy combinations tried, the rest bounded out", tried, len(combos))
    return best


def plan_pipeline(facts: PipelineFacts, mode: PerformanceMode | str = PerformanceMode.AUTO,
                  overrides: Mapping[str, ComponentOverride] | None = None) -> PipelinePlan:
    """One plan for ``facts`` in ``mode``; ``overrides`` pin fields per component name."""
    mode = PerformanceMode(mode)
    overrides = dict(overrides or {})
    unknown = set(overrides) - {p.name for p in facts.components}
    if unknown:
        raise ValueError(f"overrides name unknown components {sorted(unknown)}")
    budget = facts.weight_budget
    if mode in (PerformanceMode.SPEED, PerformanceMode.MEMORY):
        plan = _fixed(facts, mode, overrides, budget)
        why = f"{mode.value} mode: strategies fixed by the mode"
    else:
        if mode is PerformanceMode.BALANCED:
            floor = _fixed(facts, PerformanceMode.MEMORY, overrides, budget).peak_device_bytes
            budget = min(budget, max(int(BALANCED_FRACTION * budget), floor))
        plan = _search(facts, mode, overrides, budget)
        plan = dataclasses.replace(plan, weight_budget=facts.weight_budget, feasible=plan.peak_device_bytes <= budget)
        why = (f"{mode.value} mode: fastest of every strategy combination within {budget / 2**30:.2f} GiB of weights, "
               "resident layers added while streaming was not hidden behind compute")
    if not plan.feasible:
        why += f"; no plan fits: predicted peak {plan.peak_device_bytes} B > budget {budget} B"
    if plan.pinned_bytes > facts.host_lease_bytes:
        # Pins never take the lease past what staging needs (host_tiers), so only the staging floor is over.
        why += (f"; host lease short: the staging buffers alone pin {plan.staging_bytes / 2**30:.2f} GiB "
                f"(two of each streamed component's largest staged layer, whatever the tiers) of a "
                f"{facts.host_lease_bytes / 2**30:.2f} GiB lease")
    # Staged tiers were priced at link.staged_Bps, measured with this many copier threads: run as many.
    plan = dataclasses.replace(plan, components=tuple(
        dataclasses.replace(c, copier_threads=facts.link.copier_threads) for c in plan.components))
    plan = dataclasses.replace(plan, notes=(why, *(f"override {n}: {o.describe()} fixed, the rest planned"
                                                    for n, o in overrides.items())))
    for line in plan.explain():
        logger.info("plan: %s", line)
    return plan


def retier(plan: PipelinePlan, tiers: Mapping[str, Mapping[str, HostingTier]], why: Sequence[str] = ()) -> PipelinePlan:
    """``plan`` with the host's tiers per layer, every prediction recomputed from the plan's facts.

    The host-memory plan may lower tiers the planner chose (a short node: pageable layers left
    MAPPED, pins given back); bytes moved and transfer time then change, device bytes do not.
    """
    if plan.facts is None:
        raise ValueError("the plan carries no facts to re-predict from: make it with plan_pipeline")
    unknown = set(tiers) - {c.name for c in plan.components}
    if unknown:
        raise ValueError(f"tiers name components the plan does not have: {sorted(unknown)}")
    plans = {c.name: dataclasses.replace(c, hosting=tuple((key, tiers.get(c.name, {}).get(key, tier))
                                                          for key, tier in c.hosting))
             for c in plan.components}
    again = _evaluate(plan.facts, plan.mode, plans, {}, plan.weight_budget, assign_hosting=False)
    logger.info("plan re-predicted after re-tiering: %.3f GiB moved per request (was %.3f), %.3f s (was %.3f)",
                again.bytes_moved_per_request / 2**30, plan.bytes_moved_per_request / 2**30,
                again.time_s_per_request, plan.time_s_per_request)
    return dataclasses.replace(again, weight_budget=plan.weight_budget, feasible=plan.feasible,
                               notes=(*plan.notes, *why))


def memory_floor_bytes(facts: PipelineFacts, overrides: Mapping[str, ComponentOverride] | None = None) -> int:
    """The device weight bytes of the leanest plan (the memory mode's peak): a working set larger
    than the capacity minus this would leave the weights no plan that fits. Not logged: no plan is made."""
    return _fixed(facts, PerformanceMode.MEMORY, dict(overrides or {}), facts.weight_budget).peak_device_bytes


def repredict(plan: PipelinePlan, facts: PipelineFacts, why: Sequence[str] = ()) -> PipelinePlan:
    """The same decisions (strategies, resident layers, depths, tiers) predicted from other facts of the
    same components: measured compute, a working set. Device and host bytes do not change; times,
    the weight budget and feasibility may."""
    if {c.name for c in plan.components} != {c.name for c in facts.components}:
        raise ValueError(f"facts describe {[c.name for c in facts.components]}, the plan "
                         f"{[c.name for c in plan.components]}: re-predicting needs the same components")
    again = _evaluate(facts, plan.mode, {c.name: c for c in plan.components}, {}, facts.weight_budget,
                      assign_hosting=False)
    return dataclasses.replace(again, notes=(*plan.notes, *why))
