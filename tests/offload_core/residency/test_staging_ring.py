"""A plan's wider staging ring: leased on the host, run by the engine, narrowed to two when the host is short."""
from __future__ import annotations

import dataclasses

import torch

from offload_core.host.budget import InProcessLedger
from offload_core.host.tier import HostingTier
from offload_core.planner.search import repredict
from offload_core.residency.lifecycle import PipelineResidency
from tests.offload_core.residency.test_lifecycle import Toy, mapped_toys, toy_plan

LAYER = 1536  # a Toy layer's flat buffer: what it pins, copies out of its mapping, and one staging buffer holds


def pageable_b(buffers: int):
    """The toy plan with component b's layers PAGEABLE (a every layer PINNED) and ``buffers`` staging buffers."""
    plan = toy_plan(10_000)
    plan = dataclasses.replace(plan, components=tuple(
        dataclasses.replace(c, hosting=tuple((k, HostingTier.PAGEABLE) for k, _ in c.hosting), staging_buffers=buffers)
        if c.name == "b" else c for c in plan.components))
    return repredict(plan, plan.facts)  # its staging and pinned bytes counted


def run_b(res) -> None:
    x = torch.randn(2, 16)
    with torch.no_grad(), res.stage(["b"]):
        assert torch.equal(res.components["b"].module(x), Toy(1)(x)), "staged layers stream bitwise equal"


def test_a_planned_wider_staging_ring_is_leased_and_run_as_planned(cpu_capacity, tmp_path, remove_after):
    cpu_capacity(10_000)
    ledger = InProcessLedger(10**6)
    planned = pageable_b(3)
    assert planned.staging_bytes == 3 * LAYER and planned.pinned_bytes == (4 + 3) * LAYER
    res = remove_after(PipelineResidency.apply(mapped_toys(tmp_path), planned, "cpu", ledger, owner="toy"))
    assert res.components["b"].streamer.staging_bytes == 3 * LAYER == res.plan.staging_bytes
    assert ledger.leased() == (4 + 4 + 3) * LAYER, "a's pins, b's copies out of the mapping, b's three buffers"
    run_b(res)


def test_a_short_host_narrows_the_ring_to_two_says_so_and_keeps_every_tier(cpu_capacity, tmp_path, remove_after):
    cpu_capacity(10_000)
    short = InProcessLedger((4 + 4 + 2) * LAYER)
    planned = pageable_b(3)
    res = remove_after(PipelineResidency.apply(mapped_toys(tmp_path), planned, "cpu", short, owner="toy"))
    assert [c.hosting for c in res.plan.components] == [c.hosting for c in planned.components]
    assert res.plan.component("b").staging_buffers == 2
    assert res.components["b"].streamer.staging_bytes == 2 * LAYER == res.plan.staging_bytes
    assert any("staging ring narrowed from 3 to 2 buffers" in note for note in res.plan.notes), res.plan.notes
    run_b(res)
