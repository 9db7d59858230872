"""The plan search's branch and bound: the bound never exceeds what a combination reaches, so the
bounded search plans exactly what trying every combination plans."""
from __future__ import annotations

import dataclasses
import itertools
import math

import pytest

from offload_core.planner import search
from offload_core.planner.facts import PipelineFacts
from offload_core.planner.inputs import GiB, GpuSpec, real_model_facts
from offload_core.planner.search import ComponentOverride, PerformanceMode, plan_pipeline
from offload_core.planner.search_bound import MARGIN_S, combination_time_bound, component_bounds, fillable, pin_room
from offload_core.planner.strategy import Strategy

GPU = GpuSpec("test-gpu", 24 * GiB, pinned_Bps=25e9, flops=100e12)
# Device sizes where the budget binds differently (little resident, some components resident, all), with
# a short and an ample host lease, in the two modes that search.
CASES = [(12, 8, PerformanceMode.AUTO), (24, 64, PerformanceMode.AUTO), (24, 8, PerformanceMode.BALANCED),
         (141, 64, PerformanceMode.AUTO)]


@pytest.fixture(scope="module", params=["wan2.1-t2v-14b", "flux.1-dev", "wan2.1-i2v-14b-480p"])
def real_facts(request):
    facts, _notes = real_model_facts(request.param, GPU, 64 * GiB)
    return facts


def sized(facts: PipelineFacts, gb: int, lease_gb: int) -> PipelineFacts:
    return dataclasses.replace(facts, device_capacity=gb * GiB, device_name=f"{gb}GB", host_lease_bytes=lease_gb * GiB)


def every_combination(facts: PipelineFacts, budget: int, overrides=None):
    """(bound, the plan the search makes of it) for each combination, in ``itertools.product`` order."""
    overrides = overrides or {}
    options = [search._options(p, overrides.get(p.name, ComponentOverride())) for p in facts.components]
    cache = {}
    for combo in itertools.product(*options):
        bounds = [component_bounds(p, [o], facts.link, fillable(p, overrides),
                                   pin_room(facts, p, overrides))[0] for p, o in zip(facts.components, combo)]
        plans = {p.name: o for p, o in zip(facts.components, combo)}
        filled = search._fill_residents(facts, PerformanceMode.AUTO, plans, overrides, budget, cache)
        yield combination_time_bound(facts, bounds, budget), search._fit_windows(
            facts, PerformanceMode.AUTO, filled, overrides, budget, cache)


@pytest.mark.parametrize("gb, lease_gb, mode", CASES)
def test_the_bounded_search_plans_what_trying_every_combination_plans(real_facts, gb, lease_gb, mode):
    facts = sized(real_facts, gb, lease_gb)
    plan = plan_pipeline(facts, mode)
    budget = plan.weight_budget
    if mode is PerformanceMode.BALANCED:
        floor = plan_pipeline(facts, PerformanceMode.MEMORY).peak_device_bytes
        budget = min(budget, max(int(search.BALANCED_FRACTION * budget), floor))
    tried = list(every_combination(facts, budget))
    for bound, candidate in tried:
        if candidate.feasible:  # no feasible plan of a combination is faster than its bound
            assert bound <= candidate.time_s_per_request + MARGIN_S, (bound, candidate.explain())
    assert gb > 24 or any(bound == math.inf for bound, _ in tried), "no combination was found unable to fit"
    plans = [candidate for _, candidate in tried]
    expected = plans[min(range(len(plans)), key=lambda i: (search._key(plans[i]), i))]  # the first of the best
    assert [c.decisions() for c in plan.components] == [c.decisions() for c in expected.components]
    assert (plan.time_s_per_request, plan.bytes_moved_per_request, plan.peak_device_bytes, plan.pinned_bytes) == (
        expected.time_s_per_request, expected.bytes_moved_per_request, expected.peak_device_bytes,
        expected.pinned_bytes)


def test_a_hand_pinned_strategy_and_resident_count_bound_only_what_they_leave_open(real_facts):
    facts = sized(real_facts, 24, 64)
    streamed = next(p.name for p in facts.components if p.layers and p.uses_per_request > 1)
    overrides = {streamed: ComponentOverride(strategy=Strategy.LAYERWISE, resident_layers=2)}
    plans = [p for _, p in every_combination(facts, facts.weight_budget, overrides)]
    expected = plans[min(range(len(plans)), key=lambda i: (search._key(plans[i]), i))]
    plan = plan_pipeline(facts, PerformanceMode.AUTO, overrides)
    assert plan.component(streamed).resident_layers == 2
    assert [c.decisions() for c in plan.components] == [c.decisions() for c in expected.components]
