"""One pass on the copy and compute streams: the engine's issue rule, hidden or exposed copies, staging."""
from __future__ import annotations

import dataclasses

import pytest

from offload_core.host.tier import HostingTier
from offload_core.planner.facts import ComponentProfile, LinkFacts
from offload_core.planner.pipeline_plan import ComponentPlan
from offload_core.planner.strategy import Strategy
from offload_core.planner.timeline import Lane, SpanKind, TimelineSource, measured_timeline, predicted_timeline
from tests.offload_core.tiny_models import toy_layer

# 1024 B layers: 2 s per DMA at 512 B/s pinned, 10 s per staging memcpy at 102.4 B/s.
LINK = LinkFacts(pinned_Bps=512.0, pageable_Bps=102.4)


def profile(n=6, compute_s=1.0, rest_s=0.5) -> ComponentProfile:
    layers = tuple(toy_layer(f"blocks.{i}", 1024) for i in range(n))
    return ComponentProfile("dit", "Toy", ("blocks",), layers, 512, 0, 10, (compute_s,) * n, rest_s)


def layerwise(p: ComponentProfile, resident=0, depth=1, tier=HostingTier.PINNED, tiers=None) -> ComponentPlan:
    tiers = tiers or {layer.key: tier for layer in p.layers}
    return ComponentPlan("dit", Strategy.LAYERWISE, ("blocks",), resident, depth, False, False,
                         tuple((layer.key, tiers[layer.key]) for layer in p.layers))


def computes(timeline):
    return [s for s in timeline.lane(Lane.COMPUTE) if s.kind is SpanKind.COMPUTE]


def test_copies_hidden_behind_compute_leave_the_compute_stream_without_gaps():
    p = profile(compute_s=3.0)  # a 2 s copy hides behind a 3 s layer
    t = predicted_timeline(p, layerwise(p), LINK)
    spans = computes(t)
    assert t.source is TimelineSource.PREDICTED
    assert t.pass_s == pytest.approx(0.5 + 6 * 3.0)
    assert all(b.start_s == pytest.approx(a.end_s) for a, b in zip(spans, spans[1:]))
    assert t.busy_s(Lane.COPY) == pytest.approx(6 * 2.0)


def test_a_copy_bound_pass_takes_the_copies_and_each_layer_starts_when_its_copy_lands():
    p = profile(compute_s=0.25)
    t = predicted_timeline(p, layerwise(p), LINK)
    copies = {s.layer: s for s in t.lane(Lane.COPY)}
    for span in computes(t):
        assert span.start_s == pytest.approx(max(copies[span.layer].end_s, span.start_s))
        assert span.start_s >= copies[span.layer].end_s - 1e-9, f"{span.layer} computed before its copy landed"
    # The steady state is bound by the copy stream: within one layer's copy of the cost model's bound.
    bound = max(0.5 + 6 * 0.25, 6 * 2.0)
    assert bound <= t.pass_s <= bound + 2.0


@pytest.mark.parametrize("compute_s", [0.25, 3.0])
@pytest.mark.parametrize("depth", [1, 2, 3])
def test_no_copy_starts_before_the_engine_issues_it_and_never_more_layers_than_slots(depth, compute_s):
    # The pre-hook of streamed layer j issues the copy of j + depth: its slot is the one layer j - 1 freed.
    p = profile(compute_s=compute_s)
    t = predicted_timeline(p, layerwise(p, depth=depth), LINK)
    slots = depth + 1
    starts = {s.layer: s.start_s for s in computes(t)}
    order = [s.layer for s in computes(t)]
    for i, layer in enumerate(order):
        copy = next(s for s in t.lane(Lane.COPY) if s.layer == layer)
        if i >= slots:  # the first ones were issued in the pass before
            assert copy.start_s >= starts[order[i - depth]] - 1e-9
    for moment in [s.start_s + 1e-6 for s in t.spans]:
        held = sum(1 for layer in order
                   if next(c for c in t.lane(Lane.COPY) if c.layer == layer).start_s <= moment
                   < next(c for c in computes(t) if c.layer == layer).end_s)
        assert held <= slots


def test_resident_layers_copy_nothing_in_the_pass():
    p = profile()
    t = predicted_timeline(p, layerwise(p, resident=4), LINK)
    assert {s.layer for s in t.lane(Lane.COPY)} == {"blocks.4", "blocks.5"}
    assert [s.layer for s in computes(t)] == [f"blocks.{i}" for i in range(6)]


def test_staged_layers_are_copied_into_two_staging_buffers_before_their_dma():
    p = profile(compute_s=0.25)
    tiers = {layer.key: (HostingTier.PINNED if i % 3 == 0 else HostingTier.PAGEABLE) for i, layer in enumerate(p.layers)}
    t = predicted_timeline(p, layerwise(p, tiers=tiers), LINK)
    stages = {s.layer: s for s in t.lane(Lane.STAGING)}
    dmas = {s.layer: s for s in t.lane(Lane.COPY)}
    assert set(stages) == {k for k, tier in tiers.items() if tier is HostingTier.PAGEABLE}
    for key, stage in stages.items():
        assert stage.end_s - stage.start_s == pytest.approx(10.0)
        assert dmas[key].start_s >= stage.end_s - 1e-9, f"{key}: DMA before its staging memcpy ended"
    # A staging buffer is refilled only after the DMA out of it landed (two buffers).
    staged = sorted(stages.values(), key=lambda s: s.start_s)
    for earlier, later in zip(staged, staged[2:]):
        assert later.start_s >= dmas[earlier.layer].end_s - 1e-9


def test_resident_and_model_offloaded_components_show_compute_and_at_most_one_whole_copy():
    p = profile()
    resident = dataclasses.replace(layerwise(p), strategy=Strategy.RESIDENT, hosting=())
    t = predicted_timeline(p, resident, LINK)
    assert not t.lane(Lane.COPY) and t.pass_s == pytest.approx(0.5 + 6.0)
    offloaded = dataclasses.replace(resident, strategy=Strategy.MODEL_OFFLOAD, uses_per_request=1)
    t = predicted_timeline(p, offloaded, LINK)
    (copy,) = t.lane(Lane.COPY)
    assert copy.end_s == pytest.approx((512 + 6 * 1024) / 102.4)
    assert computes(t)[0].start_s >= copy.end_s


def test_a_measured_pass_lays_out_each_layer_s_wait_then_its_compute_in_the_order_they_ran():
    t = measured_timeline("dit", [("blocks.1", 0.2), ("blocks.0", 0.1)], [("blocks.1", 0.05)], 0.3)
    assert t.source is TimelineSource.MEASURED
    assert [(s.kind, s.layer) for s in t.spans] == [(SpanKind.REST, ""), (SpanKind.WAIT, "blocks.1"),
                                                    (SpanKind.COMPUTE, "blocks.1"), (SpanKind.COMPUTE, "blocks.0")]
    assert t.pass_s == pytest.approx(0.65)


def test_a_recorded_pass_puts_its_copies_on_the_copy_stream_beside_the_compute():
    from offload_core.planner.measured_compute import RecordedPass
    from offload_core.planner.timeline import recorded_timeline

    recorded = RecordedPass(compute=(("blocks.0", 0.1, 0.3), ("blocks.1", 0.35, 0.5)),
                            waits=(("blocks.1", 0.3, 0.35),), rest=((0.0, 0.1), (0.5, 0.6)),
                            copies=(("blocks.0", -0.2, 0.05), ("blocks.1", 0.12, 0.34)), pass_s=0.6)
    t = recorded_timeline("dit", recorded)
    assert t.source is TimelineSource.MEASURED and t.pass_s == 0.6
    assert [(s.layer, s.start_s, s.end_s) for s in t.lane(Lane.COPY)] == [("blocks.0", -0.2, 0.05),
                                                                          ("blocks.1", 0.12, 0.34)]
    assert {s.kind for s in t.lane(Lane.COPY)} == {SpanKind.COPY}
    assert [(s.kind, s.layer) for s in t.lane(Lane.COMPUTE)] == [
        (SpanKind.REST, ""), (SpanKind.COMPUTE, "blocks.0"), (SpanKind.WAIT, "blocks.1"),
        (SpanKind.COMPUTE, "blocks.1"), (SpanKind.REST, "")]
    assert t.busy_s(Lane.COPY) == pytest.approx(0.25 + 0.22)
