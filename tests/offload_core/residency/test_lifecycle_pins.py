"""A pin the driver refuses: the residency's plan and report say PAGEABLE for that layer, with a note."""
from __future__ import annotations

import torch

from offload_core.host import pinned
from offload_core.host.tier import HostingTier
from offload_core.residency.lifecycle import PipelineResidency
from tests.offload_core.host.test_pinned import FakeLocker
from tests.offload_core.residency.test_lifecycle import toy_plan, toys


def test_a_refused_pin_is_in_the_plan_and_the_report_and_the_output_stays_exact(
        cpu_capacity, monkeypatch, remove_after):
    cpu_capacity(10**9)
    plan = toy_plan(10**9)
    pinned_keys = [key for key, tier in plan.component("b").hosting if tier is HostingTier.PINNED]
    assert pinned_keys, "the toy plan must pin some of b's layers for this test to mean anything"
    fake = FakeLocker(refuse=range(1, 1000))  # a memlock limit of zero: every registration refused
    monkeypatch.setattr(pinned, "page_locker", lambda device: fake)
    plain, models = toys(), toys()
    res = remove_after(PipelineResidency.apply(models, plan, "cpu"))
    hosted = dict(res.plan.component("b").hosting)
    assert all(hosted[key] is HostingTier.PAGEABLE for key in pinned_keys)
    assert any(f"b: {len(pinned_keys)} layers PAGEABLE instead of PINNED" in note for note in res.plan.notes)
    report = dict(res.report().component("b").layer_tiers)
    assert report["pinned"] == 0 and report["pageable"] == len(hosted)
    x = torch.randn(2, 16)
    with torch.no_grad(), res.stage(["b"]):
        assert torch.equal(models["b"](x), plain["b"](x))
    res.remove()
    assert fake.locked == {}


def test_refused_staging_buffers_are_a_note_in_the_plan(cpu_capacity, monkeypatch, remove_after):
    cpu_capacity(10**9)
    plan = toy_plan(10**9)
    fake = FakeLocker(refuse=range(1, 1000))
    monkeypatch.setattr(pinned, "page_locker", lambda device: fake)
    res = remove_after(PipelineResidency.apply(toys(), plan, "cpu"))
    staged = [name for name, c in res.components.items() if c.streamer is not None and c.streamer.staging is not None]
    assert staged, "the toy plan must stage some layers for this test to mean anything"
    for name in staged:
        assert any(note.startswith(f"{name}: staging buffers not pinned") and "copied unstaged" in note
                   for note in res.plan.notes), res.plan.notes
    assert any("copied unstaged" in line for line in res.plan.explain())
