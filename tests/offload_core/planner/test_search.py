"""The planner: modes, monotone feasible plans for real-size models, residents hiding transfer, overrides."""
from __future__ import annotations

import dataclasses

import pytest

from offload_core.host.tier import HostingTier
from offload_core.planner.facts import (
    ComponentProfile,
    LinkFacts,
    PipelineFacts,
    Stage,
)
from offload_core.planner.inputs import GiB, GpuSpec, real_model_facts
from offload_core.planner.search import (
    ComponentOverride,
    PerformanceMode,
    plan_pipeline,
)
from offload_core.planner.strategy import Strategy
from offload_core.residency.components import streaming_config
from tests.offload_core.tiny_models import toy_layer

DEVICES_GB = (12, 24, 48, 80, 141)
# One link and compute rate for every size, so only memory changes between the plans compared.
GPU = GpuSpec("test-gpu", 24 * GiB, pinned_Bps=25e9, flops=100e12)


@pytest.fixture(scope="module", params=["wan2.1-t2v-14b", "flux.1-dev"])
def real_facts(request):
    facts, _notes = real_model_facts(request.param, GPU, 64 * GiB)
    return facts


def sized(facts: PipelineFacts, gb: int) -> PipelineFacts:
    return dataclasses.replace(facts, device_capacity=gb * GiB, device_name=f"{gb}GB")


def test_real_size_plans_are_feasible_on_every_device_and_more_memory_never_plans_slower(real_facts):
    times = []
    for gb in DEVICES_GB:
        plan = plan_pipeline(sized(real_facts, gb), PerformanceMode.AUTO)
        assert plan.feasible and plan.peak_device_bytes <= plan.weight_budget, plan.explain()
        times.append(plan.time_s_per_request)
        assert plan_pipeline(sized(real_facts, gb), PerformanceMode.MEMORY).feasible
    assert all(later <= earlier for earlier, later in zip(times, times[1:])), times
    assert times[-1] < times[0], "a 141 GB device should plan faster than a 12 GB one"


def test_speed_mode_is_all_resident_and_fits_only_the_big_devices(real_facts):
    fits = [plan_pipeline(sized(real_facts, gb), PerformanceMode.SPEED).feasible for gb in DEVICES_GB]
    plan = plan_pipeline(sized(real_facts, 141), PerformanceMode.SPEED)
    assert all(c.strategy is Strategy.RESIDENT for c in plan.components)
    assert plan.bytes_moved_per_request == 0
    assert fits[0] is False and fits[-1] is True


def test_memory_mode_streams_with_nothing_resident_and_the_smallest_peak(real_facts):
    facts = sized(real_facts, 24)
    memory = plan_pipeline(facts, PerformanceMode.MEMORY)
    for c in memory.components:
        assert c.resident_layers == 0
        assert c.strategy is (Strategy.LAYERWISE if c.hosting else Strategy.MODEL_OFFLOAD)
    for mode in (PerformanceMode.AUTO, PerformanceMode.BALANCED, PerformanceMode.SPEED):
        assert memory.peak_device_bytes <= plan_pipeline(facts, mode).peak_device_bytes


def test_balanced_stays_within_half_the_device_when_memory_mode_fits_there(real_facts):
    facts = sized(real_facts, 80)
    balanced = plan_pipeline(facts, PerformanceMode.BALANCED)
    assert balanced.peak_device_bytes <= facts.weight_budget // 2
    assert balanced.time_s_per_request >= plan_pipeline(facts, PerformanceMode.AUTO).time_s_per_request


# Layers of 1024 B: a multiple of the layout's 512 B alignment, so flat bytes == tensor bytes.
def uniform(n=10, layer_bytes=1024, compute_s=1.0, uses=10, non_layer=512, name="dit"):
    layers = tuple(toy_layer(f"blocks.{i}", layer_bytes) for i in range(n))
    return ComponentProfile(name, "Toy", ("blocks",), layers, non_layer, 0, uses, (compute_s,) * n)


def one_component(capacity, link=LinkFacts(pinned_Bps=512.0, pageable_Bps=102.4), lease=10**9, **kw):
    return PipelineFacts((uniform(**kw),), (Stage("denoise", ("dit",)),), capacity, link, lease)


def test_resident_layers_are_added_until_streaming_hides_behind_compute():
    # A layer copies in 2 s and computes in 1 s: 10 s of compute per use hides 5 streamed layers.
    plan = plan_pipeline(one_component(capacity=9_216), PerformanceMode.AUTO)
    dit = plan.component("dit")
    assert dit.strategy is Strategy.LAYERWISE and dit.resident_layers == 5
    assert dit.prediction.time_s == pytest.approx(10 * 10.0 + 5 * 1024 / 512.0)  # compute + resident copy once
    # Less room: as many residents as fit (non-layer 512 + r x 1024 + 2 slots x 1024 <= 5632).
    assert plan_pipeline(one_component(capacity=5_632), PerformanceMode.AUTO).component("dit").resident_layers == 3


def test_a_batch_that_shares_each_use_divides_the_bytes_each_request_moves():
    alone = plan_pipeline(one_component(capacity=5_500), PerformanceMode.MEMORY)
    facts = one_component(capacity=5_500)
    batched = dataclasses.replace(facts, components=(dataclasses.replace(facts.components[0], expected_batch=4.0),))
    shared = plan_pipeline(batched, PerformanceMode.MEMORY)
    assert alone.bytes_moved_per_request > 0
    assert shared.bytes_moved_per_request == round(alone.bytes_moved_per_request / 4)
    assert shared.peak_device_bytes == alone.peak_device_bytes, "the batch shares slots, not more of them"
    with pytest.raises(ValueError, match="expected_batch"):
        dataclasses.replace(facts.components[0], expected_batch=0.5)


def test_when_everything_fits_auto_plans_the_speed_plan():
    auto = plan_pipeline(one_component(capacity=10**6), PerformanceMode.AUTO)
    assert auto.component("dit").strategy is Strategy.RESIDENT and auto.bytes_moved_per_request == 0


def test_a_hand_pinned_field_is_kept_and_the_rest_is_still_planned():
    facts = one_component(capacity=9_216)
    plan = plan_pipeline(facts, PerformanceMode.AUTO, {"dit": ComponentOverride(prefetch_depth=2, resident_layers=1)})
    dit = plan.component("dit")
    assert (dit.prefetch_depth, dit.resident_layers, dit.strategy) == (2, 1, Strategy.LAYERWISE)
    assert "override dit: resident_layers=1, prefetch_depth=2 fixed, the rest planned" in plan.notes
    hosted = plan_pipeline(facts, PerformanceMode.AUTO, {"dit": ComponentOverride(hosting=HostingTier.MAPPED)})
    assert "override dit: hosting=mapped fixed, the rest planned" in hosted.notes
    with pytest.raises(ValueError, match="unknown components"):
        plan_pipeline(facts, PerformanceMode.AUTO, {"nope": ComponentOverride(park=True)})


def test_pins_follow_the_host_lease_in_layer_order():
    # 10 layers of 1,024 B, a 3,584 B lease: pageable layers need two 1,024 B staging buffers, so
    # one pin fits beside them (1,024 + 2,048), two would not (2,048 + 2,048).
    plan = plan_pipeline(one_component(capacity=4_096, lease=3_584), PerformanceMode.MEMORY)
    tiers = [tier for _, tier in plan.component("dit").hosting]
    assert tiers == [HostingTier.PINNED] + [HostingTier.PAGEABLE] * 9
    assert plan.pinned_bytes == 1_024 + 2_048 and plan.staging_bytes == 2_048
    everything = plan_pipeline(one_component(capacity=4_096, lease=10_240), PerformanceMode.MEMORY)
    assert {tier for _, tier in everything.component("dit").hosting} == {HostingTier.PINNED}
    assert everything.pinned_bytes == 10_240 and everything.staging_bytes == 0, "all pinned: nothing staged"


def test_pins_leave_the_lease_room_for_the_staging_of_components_offered_pins_later():
    # The dit (10 layers of 1,024 B, 10 uses) is offered pins first; the encoder (4 layers of 2,048 B, one
    # use) after it, none of its layers pinnable once the dit took the lease: it stages all of them through
    # two 2,048 B buffers. A 10,240 B lease pins 4 dit layers (4,096 B) beside the dit's own staging (2,048)
    # and the encoder's (4,096 B: every one of its layers would stage), not all 10 with nothing left for it.
    encoder = uniform(n=4, layer_bytes=2048, uses=1, name="encoder")
    facts = PipelineFacts((encoder, uniform()), (Stage("encode", ("encoder",)), Stage("denoise", ("dit",))),
                          20_000, LinkFacts(pinned_Bps=512.0, pageable_Bps=102.4), 10_240)
    plan = plan_pipeline(facts, PerformanceMode.MEMORY)
    tiers = {name: [tier for _, tier in plan.component(name).hosting] for name in ("dit", "encoder")}
    assert tiers["encoder"] == [HostingTier.PAGEABLE] * 4
    assert tiers["dit"] == [HostingTier.PINNED] * 4 + [HostingTier.PAGEABLE] * 6
    assert plan.pinned_bytes <= facts.host_lease_bytes, plan.explain()
    assert plan.staging_bytes == 2 * 1024 + 2 * 2048


@pytest.mark.parametrize("mode", list(PerformanceMode))
def test_a_real_size_plan_never_pins_more_than_the_host_lease(mode):
    # FLUX.1-dev on an RTX3060 with 24 GiB of host RAM: 22.66 GiB pinned against a 22.0 GiB lease in auto
    # mode before pins left room for T5's staging. Of the 1,980 plans bench/plan_leases.py makes (every real
    # model x GPU x 8-64 GiB x mode), 481 were over, by up to 2.83 GiB; none since.
    facts, _notes = real_model_facts("flux.1-dev", GpuSpec("RTX3060", 12 * GiB, pinned_Bps=25e9, flops=10e12),
                                     24 * GiB)
    plan = plan_pipeline(facts, mode)
    assert plan.pinned_bytes <= facts.host_lease_bytes, (plan.pinned_bytes, facts.host_lease_bytes)


def test_a_host_lease_below_the_staging_floor_is_said_in_the_plan():
    plan = plan_pipeline(one_component(capacity=4_096, lease=1_024), PerformanceMode.MEMORY)
    assert plan.pinned_bytes == plan.staging_bytes == 2_048, "nothing pinned: the staging floor is all it pins"
    assert "host lease short: the staging buffers alone pin 0.00 GiB" in plan.notes[0]
    roomy = plan_pipeline(one_component(capacity=4_096, lease=2_048), PerformanceMode.MEMORY)
    assert "host lease short" not in " ".join(roomy.notes)


def test_the_plan_configures_the_engine():
    dit = plan_pipeline(one_component(capacity=9_216), PerformanceMode.AUTO).component("dit")
    config = streaming_config(dit)
    assert config.layer_groups == ("blocks",) and config.resident == dit.resident_layers
    assert config.prefetch_depth == dit.prefetch_depth and dict(config.hosting) == dict(dit.hosting)


def test_an_infeasible_plan_says_why_with_the_numbers():
    plan = plan_pipeline(one_component(capacity=100), PerformanceMode.AUTO)
    assert not plan.feasible
    assert "no plan fits" in plan.notes[0] and str(plan.peak_device_bytes) in plan.notes[0]
    lines = plan.explain()
    assert lines[0].startswith("auto plan") and "INFEASIBLE" in lines[0]
    assert lines[1].startswith("dit: ")


def test_facts_refuse_negative_sizes_and_components_outside_the_stages():
    with pytest.raises(ValueError, match="device_capacity must be >= 0"):
        one_component(capacity=-1)
    with pytest.raises(ValueError, match="each must be in one stage"):
        PipelineFacts((uniform(),), (Stage("denoise", ("other",)),), 10, LinkFacts(1.0, 1.0), 0)
    with pytest.raises(ValueError, match="bandwidths must be > 0"):
        LinkFacts(0.0, 1.0)


@pytest.mark.parametrize("compute_s,bound", [(20.0, "compute"), (1.0, "host memcpy")])
def test_staged_pageable_copies_overlap_compute_in_the_prediction(compute_s, bound):
    # No host lease: every layer PAGEABLE, copied through staging. Per use the DMA moves 10 KiB at
    # 512 B/s (20 s) while the host memcpy into staging runs at the pageable rate (100 s): a use
    # takes the slowest of compute, DMA and memcpy, not compute plus the copies.
    plan = plan_pipeline(one_component(capacity=4_096, lease=0, compute_s=compute_s), PerformanceMode.MEMORY)
    p = plan.component("dit").prediction
    assert {tier for _, tier in plan.component("dit").hosting} == {HostingTier.PAGEABLE}
    once = (512 / 102.4) if p.parked else 0.0  # parked non-layer weights come back once per request
    per_use = 10 * compute_s if bound == "compute" else 10 * 1024 / 102.4
    assert p.time_s == pytest.approx(once + 10 * per_use)
    assert p.staging_bytes == plan.staging_bytes == 2 * 1024


def test_measured_compute_that_hides_transfer_needs_fewer_resident_layers_than_0_s():
    # A layer copies in 2 s. With 0 s of compute nothing hides a copy: every resident layer saves
    # time, so AUTO keeps as many as fit (6 in 9216 B). Measured at 3 s per layer, 30 s per use hide
    # all ten streamed layers' 20 s of copies: no resident layer is worth its bytes.
    unmeasured = plan_pipeline(one_component(capacity=9_216, compute_s=0.0), PerformanceMode.AUTO).component("dit")
    measured = plan_pipeline(one_component(capacity=9_216, compute_s=3.0), PerformanceMode.AUTO).component("dit")
    assert unmeasured.strategy is measured.strategy is Strategy.LAYERWISE
    assert (unmeasured.resident_layers, measured.resident_layers) == (6, 0)
    assert measured.prediction.time_s == pytest.approx(10 * 30.0), "the copies hide behind compute"


def test_a_working_set_is_taken_from_the_weights_room_and_shown_in_the_explanation():
    roomy = plan_pipeline(one_component(capacity=9_216, compute_s=0.0), PerformanceMode.AUTO)
    facts = dataclasses.replace(one_component(capacity=9_216, compute_s=0.0), working_set_bytes=3_072)
    tight = plan_pipeline(facts, PerformanceMode.AUTO)
    assert tight.weight_budget == 6_144 and tight.peak_device_bytes <= 6_144
    assert tight.component("dit").resident_layers == 3 < roomy.component("dit").resident_layers
    assert "0.00 GiB kept for activations" in roomy.explain()[0]
    assert f"{3_072 / 2**30:.2f} GiB kept for activations" in tight.explain()[0]


def test_a_plan_re_predicted_from_measured_compute_keeps_its_decisions_and_shows_the_new_times():
    from offload_core.planner.search import memory_floor_bytes, repredict

    zero = one_component(capacity=9_216, compute_s=0.0)
    plan = plan_pipeline(zero, PerformanceMode.AUTO)
    measured = one_component(capacity=9_216, compute_s=3.0)
    again = repredict(plan, measured, ("compute measured",))
    assert [c.decisions() for c in again.components] == [c.decisions() for c in plan.components]
    assert again.peak_device_bytes == plan.peak_device_bytes and again.bytes_moved_per_request == plan.bytes_moved_per_request
    assert again.compute_s_per_request == pytest.approx(10 * 30.0) and plan.compute_s_per_request == 0
    assert again.explain()[-1] == "compute measured"
    fewer = plan_pipeline(measured, PerformanceMode.AUTO)
    assert fewer.changes_from(plan) == ("dit: resident layers 6 -> 0",)
    assert plan.changes_from(plan) == ()
    # The leanest plan: non-layer weights and two slots, whatever the compute.
    assert memory_floor_bytes(zero) == memory_floor_bytes(measured) == 512 + 2 * 1024


def test_a_layerwise_plan_explains_its_prefetch_window_in_bytes_and_layers(real_facts):
    memory = plan_pipeline(sized(real_facts, 24), PerformanceMode.MEMORY)
    streamed = [c for c in memory.components if c.strategy is Strategy.LAYERWISE]
    assert streamed
    for c in streamed:
        p = c.prediction
        fewest, most = p.window_layers
        assert p.window_bytes > 0 and 1 <= fewest <= most
        assert f"prefetch window {p.window_bytes / GiB:.2f} GiB in bytes: {fewest}-{most} layers" in c.explain()


def test_each_tier_is_priced_at_its_own_measured_rate_and_the_plan_shows_the_rates():
    # The same all-PAGEABLE plan (no host lease): its staged memcpy per use is 10 KiB at the staged
    # rate when one was measured (204.8 B/s: 50 s), at the pageable rate when not (102.4 B/s: 100 s).
    slow = plan_pipeline(one_component(capacity=4_096, lease=0, compute_s=1.0), PerformanceMode.MEMORY)
    staged_link = LinkFacts(pinned_Bps=512.0, pageable_Bps=102.4, measured=True, staged_Bps=204.8)
    fast = plan_pipeline(one_component(capacity=4_096, link=staged_link, lease=0, compute_s=1.0), PerformanceMode.MEMORY)
    assert {tier for _, tier in fast.component("dit").hosting} == {HostingTier.PAGEABLE}
    p_slow, p_fast = slow.component("dit").prediction, fast.component("dit").prediction
    once = 512 / 102.4 if p_fast.parked else 0.0  # parked weights come back by the pageable copy
    assert p_fast.time_s == pytest.approx(once + 10 * 10 * 1024 / 204.8)
    assert p_slow.time_s == pytest.approx(once + 10 * 10 * 1024 / 102.4)
    assert staged_link.rate(HostingTier.PINNED) == 512.0 and staged_link.rate(HostingTier.MAPPED) == 204.8
    (line,) = [line for line in fast.explain() if line.startswith("link ")]
    assert "link (measured): pinned 0.0 GB/s" in line and "staged 0.0 GB/s" in line
    assert any(line.startswith("link (configured)") and "staged as pageable" in line for line in slow.explain())
