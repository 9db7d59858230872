"""The picture of a plan: where every byte lives, drawn by matplotlib as SVG or PNG, the same every time."""
from __future__ import annotations

import dataclasses

import pytest

from offload_core.host.tier import HostingTier
from offload_core.planner.facts import LinkFacts, PipelineFacts, Stage
from offload_core.planner.measured_compute import MeasuredCompute
from offload_core.planner.picture import Placement, WeightFormat, plan_picture, render
from offload_core.planner.search import ComponentOverride, PerformanceMode, plan_pipeline
from offload_core.planner.timeline import Lane
from tests.offload_core.planner.test_timeline import profile

LINK = LinkFacts(pinned_Bps=512.0, pageable_Bps=102.4)


def facts(lease=10**9):
    dit = profile(n=6)
    enc = dataclasses.replace(profile(n=2), name="encoder", table_bytes=256, uses_per_request=1)
    return PipelineFacts((enc, dit), (Stage("encode", ("encoder",)), Stage("denoise", ("dit",))), 7_000, LINK, lease)


def test_every_byte_of_a_component_is_in_the_strip_where_the_plan_keeps_it():
    # The lease pins 3 of the denoiser's layers (3 x 1024 B + 2 x 1024 B of staging for the rest).
    plan = plan_pipeline(facts(lease=5_200), PerformanceMode.MEMORY, {"encoder": ComponentOverride(host_tables=True)})
    picture = plan_picture(plan)
    for comp in picture.components:
        c, p = plan.component(comp.name), plan.facts.component(comp.name)
        assert sum(s.nbytes for s in comp.segments) == p.total_bytes
        layers = {s.key: s.placement for s in comp.segments if s.key}
        assert list(layers) == [layer.key for layer in p.layers]
        if c.strategy.value == "layerwise":
            tiers = dict(c.hosting)
            for i, layer in enumerate(p.layers):
                want = Placement.DEVICE if i < c.resident_layers else Placement[tiers[layer.key].name]
                assert layers[layer.key] is want
    dit = plan.component("dit")
    assert {t for _, t in dit.hosting} == {HostingTier.PINNED, HostingTier.PAGEABLE}, "the lease pins some"
    encoder = next(c for c in picture.components if c.name == "encoder")
    assert [s.nbytes for s in encoder.segments if s.placement is Placement.HOST_TABLE] == [256]


def test_fp8_layers_keep_their_tier_colour_and_are_marked_fp8():
    plan = plan_pipeline(facts(), PerformanceMode.MEMORY)
    picture = plan_picture(plan, formats={"dit": {"blocks.2": WeightFormat.FP8}})
    dit = next(c for c in picture.components if c.name == "dit")
    marked = [s.key for s in dit.segments if s.format is WeightFormat.FP8]
    assert marked == ["blocks.2"]
    assert b"fp8 weights" in render(picture, "svg")
    assert b"fp8 weights" not in render(plan_picture(plan), "svg")


def test_svg_and_png_are_drawn_and_the_same_plan_draws_the_same_svg():
    plan = plan_pipeline(facts(), PerformanceMode.MEMORY)
    measured = {"dit": MeasuredCompute(tuple((f"blocks.{i}", 0.9) for i in range(6)), 0.4,
                                       (("blocks.3", 0.7),))}
    svg = render(plan_picture(plan, measured), "svg")
    assert svg.startswith(b"<?xml") and b"<svg" in svg
    for text in (b"dit, predicted", b"dit, measured (warm-up)", b"waiting for copies 700.0 ms", b"encoder"):
        assert text in svg, text
    assert svg == render(plan_picture(plan, measured), "svg"), "no date or random ids in the file"
    assert render(plan_picture(plan), "png").startswith(b"\x89PNG\r\n\x1a\n")


def test_a_recorded_warmup_pass_draws_its_copy_stream_beside_the_predicted_one():
    from offload_core.planner.measured_compute import RecordedPass

    plan = plan_pipeline(facts(), PerformanceMode.MEMORY)
    compute = tuple((f"blocks.{i}", 0.2 + i * 0.3, 0.45 + i * 0.3) for i in range(6))
    copies = tuple((f"blocks.{i}", i * 0.3 - 0.25, i * 0.3 + 0.15) for i in range(6))
    recorded = RecordedPass(compute, (), ((0.0, 0.2),), copies, 1.95)
    measured = {"dit": MeasuredCompute(tuple((k, b - a) for k, a, b in compute), 0.2, (), recorded)}
    picture = plan_picture(plan, measured)
    dit = next(c for c in picture.components if c.name == "dit")
    assert [s.layer for s in dit.measured.lane(Lane.COPY)] == [k for k, _, _ in copies]
    assert [s.layer for s in dit.predicted.lane(Lane.COPY)], "side by side: both passes have a copy stream"
    svg = render(picture, "svg")
    assert b"dit, measured (warm-up): one pass 1.95 s, compute 1.70 s, copies 2.40 s" in svg


def test_an_unknown_format_and_a_plan_without_facts_are_refused():
    plan = plan_pipeline(facts(), PerformanceMode.MEMORY)
    with pytest.raises(ValueError, match="svg or png, not 'jpg'"):
        render(plan_picture(plan), "jpg")
    with pytest.raises(ValueError, match="no facts"):
        plan_picture(dataclasses.replace(plan, facts=None))
