"""bench/plan_leases.py counts the plans over their host lease or device budget, and the worst overshoot."""
from __future__ import annotations

import dataclasses

from bench import plan_leases


def test_the_sweep_counts_a_plan_over_its_lease_with_how_far_and_none_when_within(monkeypatch):
    case = (("flux.1-dev",), ("RTX3060",), (24,))
    made, over_lease, over_budget, worst = plan_leases.sweep(*case)
    assert (made, over_lease, over_budget, worst) == (4, [], [], 0.0), "one plan per mode, all within"
    plan = plan_leases.plan_pipeline
    # Every plan 1 GiB more pinned than it is: over the lease wherever it pinned within 1 GiB of it.
    monkeypatch.setattr(plan_leases, "plan_pipeline", lambda facts, mode: dataclasses.replace(
        plan(facts, mode), pinned_bytes=facts.host_lease_bytes + plan_leases.GiB))
    made, over_lease, _, worst = plan_leases.sweep(*case)
    assert made == 4 and len(over_lease) == 4 and worst == 1.0
    assert over_lease[0] == "flux.1-dev RTX3060 24 GiB speed: 1.000 GiB pinned over the lease"
