"""Component residency: the stage lifecycle, strategies, and predictions equal to measurements."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from offload_core.host.budget import InProcessLedger
from offload_core.host.tier import HostingTier
from offload_core.planner.facts import (
    LinkFacts,
    PipelineFacts,
    Stage,
    profile_component,
)
from offload_core.planner.measured_compute import profiles_from_warmup
from offload_core.planner.search import (
    ComponentOverride,
    PerformanceMode,
    plan_pipeline,
)
from offload_core.planner.strategy import Strategy
from offload_core.residency.compute_meter import measure_warmup
from offload_core.residency.lifecycle import LifecycleError, PipelineResidency, UseState
from offload_core.streaming.device import get_device
from offload_core.tables import HostTablesConfig

LINK = LinkFacts(pinned_Bps=25e9, pageable_Bps=8e9)
# The tiny umT5 table is 256384 x 32 fp32 = 32.8 MB: under the 256 MiB default, so tests lower it.
TABLES = HostTablesConfig(min_bytes=1 << 20)


class Toy(nn.Module):
    offload_layer_groups = ("blocks",)

    def __init__(self, seed: int, width: int = 16, n: int = 4):
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Linear(width, width)
        self.blocks = nn.ModuleList([nn.Linear(width, width) for _ in range(n)])
        self.head = nn.Linear(width, width)

    def forward(self, x):
        x = self.embed(x)
        for block in self.blocks:
            x = torch.relu(block(x))
        return self.head(x)


STAGES = (Stage("first", ("a",)), Stage("second", ("b",)))


def toy_plan(capacity: int, mode=PerformanceMode.MEMORY, overrides=None, uses=(1, 3)):
    profiles = tuple(profile_component(name, Toy(i), uses_per_request=u)
                     for i, (name, u) in enumerate(zip("ab", uses)))
    facts = PipelineFacts(profiles, STAGES, capacity, LINK, host_lease_bytes=1 << 30)
    return plan_pipeline(facts, mode, overrides)


def toys():
    return {"a": Toy(0), "b": Toy(1)}


def nonlayer_on_device(model: Toy) -> bool:
    return model.embed.weight.numel() > 0 and model.head.weight.numel() > 0


def test_finish_before_prepare_and_prepare_twice_are_lifecycle_errors(cpu_capacity, remove_after):
    cpu_capacity(10_000)
    res = remove_after(PipelineResidency.apply(toys(), toy_plan(10_000), "cpu"))
    with pytest.raises(LifecycleError, match="not in use"):
        res.finish_use(["a"])
    res.prepare_for_use(["a"])
    with pytest.raises(LifecycleError, match="already in use"):
        res.prepare_for_use(["a"])
    with pytest.raises(KeyError, match="unknown components"):
        res.prepare_for_use(["nope"])


def test_prepare_restores_parked_weights_before_the_layers_arm_and_finish_parks_after_release(
        cpu_capacity, remove_after):
    cpu_capacity(10_000)  # tight: every non-layer byte is worth parking
    models = toys()
    plan = toy_plan(10_000)
    assert plan.component("a").prediction.parked
    res = remove_after(PipelineResidency.apply(models, plan, "cpu"))
    a = models["a"]
    assert not nonlayer_on_device(a), "a component starts out parked when the gate will park it"
    res.prepare_for_use(["a"])
    assert nonlayer_on_device(a) and a.blocks[0].weight.numel() > 0, "restored, then the first layer copied"
    with torch.no_grad():
        a(torch.randn(2, 16))
    res.finish_use(["a"])
    assert all(block.weight.numel() == 0 for block in a.blocks), "layers released"
    assert not nonlayer_on_device(a), "non-layer weights parked after the release"
    assert res.components["a"].state is UseState.OUT


def test_outputs_stay_bitwise_equal_across_stages_and_requests(cpu_capacity, remove_after):
    cpu_capacity(10_000)
    plain, models = toys(), toys()
    res = remove_after(PipelineResidency.apply(models, toy_plan(10_000), "cpu"))
    x = torch.randn(3, 16)
    for _ in range(2):
        with torch.no_grad():
            with res.stage(["a"]):
                ya = models["a"](x)
            with res.stage(["b"]):
                yb = [models["b"](ya) for _ in range(3)]
        res.finish_request()
        with torch.no_grad():
            assert torch.equal(ya, plain["a"](x))
            assert all(torch.equal(y, plain["b"](plain["a"](x))) for y in yb)


def test_finish_request_closes_a_stage_left_open_and_reports_the_request(cpu_capacity, remove_after):
    cpu_capacity(10_000)
    models = toys()
    plan = toy_plan(10_000)
    res = remove_after(PipelineResidency.apply(models, plan, "cpu"))
    res.prepare_for_use(["a"])
    with torch.no_grad():
        models["a"](torch.randn(1, 16))
    figures = res.finish_request()
    assert res.components["a"].state is UseState.OUT
    assert figures.bytes_moved == plan.component("a").prediction.bytes_moved
    assert res.finish_request().bytes_moved == 0, "counters restart with each request"


def test_model_offload_holds_nothing_on_the_device_between_its_stages(cpu_capacity, remove_after):
    cpu_capacity(10_000)
    models = toys()
    plan = toy_plan(10_000, overrides={"a": ComponentOverride(strategy=Strategy.MODEL_OFFLOAD)})
    assert plan.component("a").strategy is Strategy.MODEL_OFFLOAD
    res = remove_after(PipelineResidency.apply(models, plan, "cpu"))
    a = models["a"]
    assert all(p.numel() == 0 for p in a.parameters())
    res.prepare_for_use(["a"])
    assert all(p.numel() > 0 for p in a.parameters())
    res.finish_use(["a"])
    assert all(p.numel() == 0 for p in a.parameters())


def test_a_removed_residency_stops_counting_in_cpu_headroom_while_it_lives(cpu_capacity, remove_after):
    cpu_capacity(10**9)
    device = get_device("cpu")
    before = device.headroom_bytes()
    res = remove_after(PipelineResidency.apply(toys(), toy_plan(10**9, mode=PerformanceMode.SPEED), "cpu"))
    assert {c.strategy for c in res.plan.components} == {Strategy.RESIDENT}
    assert device.headroom_bytes() < before
    res.remove()
    assert device.headroom_bytes() == before, "a removed residency's meters still count"


def mapped_toys(tmp_path):
    """Toys whose weights are views of a safetensors file mapping, as from_pretrained leaves them."""
    from safetensors.torch import load_file, save_file

    models = {}
    for i, name in enumerate("ab"):
        path = tmp_path / f"{name}.safetensors"
        save_file(Toy(i).state_dict(), str(path))
        models[name] = Toy(i)
        models[name].load_state_dict(load_file(str(path)), assign=True)
    return models


def test_the_host_budget_fits_the_planned_tiers_with_one_lease_given_back_on_remove(
        cpu_capacity, tmp_path, remove_after):
    cpu_capacity(10_000)
    plan = toy_plan(10_000)
    layer_bytes = 1536  # a Toy layer's tensors (1088 B, all mapped) copied out into its 512-aligned flat buffer
    enough = InProcessLedger(10**6)
    res = remove_after(PipelineResidency.apply(mapped_toys(tmp_path), plan, "cpu", enough, owner="toy"))
    assert enough.leased() == 8 * layer_bytes, "one lease for the net anonymous cost of every copied layer"
    assert all(layer.tier is HostingTier.PINNED for c in res.components.values() for layer in c.streamer.layers)
    res.remove()
    assert enough.leased() == 0

    # Room for 4 of the 8 layers' copies and the two staging buffers (one layer each) of the
    # component left mapped: the first component in pin order keeps its pins, the other stages.
    short = InProcessLedger(6 * layer_bytes)
    res = remove_after(PipelineResidency.apply(mapped_toys(tmp_path), plan, "cpu", short, owner="toy"))
    tiers = [layer.tier for c in res.components.values() for layer in c.streamer.layers]
    assert tiers.count(HostingTier.MAPPED) == 4 and short.leased() == 6 * layer_bytes
    assert sum(c.streamer.staging_bytes for c in res.components.values()) == 2 * layer_bytes
    assert any("re-tiered by the host budget" in note for note in res.plan.notes)
    x = torch.randn(2, 16)
    with torch.no_grad(), res.stage(["b"]):
        assert torch.equal(res.components["b"].module(x), Toy(1)(x)), "mapped layers stream bitwise equal"
    res.remove()
    assert short.leased() == 0


def test_a_plan_re_tiered_by_the_host_predicts_what_its_requests_move(cpu_capacity, tmp_path, remove_after):
    # A layer the host left MAPPED is copied through pinned staging buffers (its flat buffer, 1536 B,
    # as a pinned one): the plan that runs, and that the report shows, must be re-predicted with the
    # host's tiers, staging bytes included.
    cpu_capacity(10_000)
    planned = toy_plan(10_000)
    short = InProcessLedger(5 * 1536)
    res = remove_after(PipelineResidency.apply(mapped_toys(tmp_path), planned, "cpu", short, owner="toy"))
    assert [c.hosting for c in res.plan.components] != [c.hosting for c in planned.components]
    assert planned.staging_bytes == 0 < res.plan.staging_bytes
    assert res.plan.staging_bytes == sum(c.streamer.staging_bytes for c in res.components.values())
    assert res.plan.bytes_moved_per_request == planned.bytes_moved_per_request, "staged or pinned: flat bytes"
    x = torch.randn(2, 16)
    for _ in range(2):  # the second request is the steady state the plan predicts too
        with torch.no_grad():
            for name, uses in (("a", 1), ("b", 3)):
                with res.stage([name]):
                    for _ in range(uses):
                        res.components[name].module(x)
        figures = res.finish_request()
        assert figures.bytes_moved == res.plan.bytes_moved_per_request
        assert figures.peak_device_bytes == res.plan.peak_device_bytes


# ---- the tiny pipelines: predictions equal measurements --------------------------------------

def materialized(comps):
    """Each weight in its own fresh allocation, as ``.to(device)`` gives on a real device.

    from_pretrained leaves CPU weights as views of the safetensors mapping at whatever alignment
    the file gives (24 mod 64 for the tiny Flux), and CPU kernels pick paths by alignment: the
    plain model is compared as it would sit on a device, not as a view of a file.
    """
    for module in comps.values():
        for p in module.parameters():
            p.data = p.data.clone()
    return comps

def _wan():
    from diffusers import WanPipeline

    from zoo.tiny import ensure_tiny_wan

    pipe = WanPipeline.from_pretrained(ensure_tiny_wan())
    comps = materialized({"text_encoder": pipe.text_encoder, "transformer": pipe.transformer, "vae": pipe.vae})
    stages = (Stage("encode", ("text_encoder",)), Stage("denoise", ("transformer",)), Stage("decode", ("vae",)))

    def call():
        return pipe("a cat", negative_prompt="blurry", height=16, width=16, num_frames=5, num_inference_steps=2,
                    generator=torch.Generator().manual_seed(0), output_type="pt").frames
    return comps, stages, call


def _flux():
    from diffusers import FluxPipeline

    from zoo.tiny import ensure_tiny_flux

    pipe = FluxPipeline.from_pretrained(ensure_tiny_flux())
    comps = materialized({"text_encoder": pipe.text_encoder, "text_encoder_2": pipe.text_encoder_2,
                          "transformer": pipe.transformer, "vae": pipe.vae})
    stages = (Stage("encode", ("text_encoder", "text_encoder_2")), Stage("denoise", ("transformer",)),
              Stage("decode", ("vae",)))

    def call():
        return pipe("a cat", height=32, width=32, num_inference_steps=2, max_sequence_length=16,
                    generator=torch.Generator().manual_seed(0), output_type="pt").images
    return comps, stages, call


# transformers 5 flattened CLIPTextModel (no ``text_model``): its layers are ``encoder.layers``.
GROUPS = {"text_encoder": ("encoder.layers",)}


@pytest.mark.parametrize("family", [_wan, _flux], ids=["wan", "flux"])
def test_tiny_pipeline_peak_and_bytes_moved_equal_the_plan_in_every_mode(family, cpu_capacity, remove_after):
    comps, stages, call = family()
    groups = GROUPS if "text_encoder_2" in comps else {}
    figures = measure_warmup(comps, call, groups)
    with torch.no_grad():
        reference = call()
    facts = PipelineFacts(profiles_from_warmup(comps, figures, TABLES, groups), stages, 0, LINK, 1 << 30)
    memory_peak = plan_pipeline(facts, PerformanceMode.MEMORY).peak_device_bytes
    # Tight enough that the parking gates park (most of) the non-layer weights.
    capacity = memory_peak + memory_peak // 2
    facts = PipelineFacts(facts.components, stages, capacity, LINK, 1 << 30)
    cpu_capacity(capacity)
    seen, staged = set(), 0
    # Every mode with room to pin everything, then the memory mode with no host lease: every
    # layer pageable, copied through staging buffers the plan must predict exactly.
    no_lease = PipelineFacts(facts.components, stages, capacity, LINK, 0)
    for mode, mode_facts in [(m, facts) for m in PerformanceMode] + [(PerformanceMode.MEMORY, no_lease)]:
        plan = plan_pipeline(mode_facts, mode)
        staged += plan.staging_bytes
        comps, _, call = family()
        res = remove_after(PipelineResidency.apply(comps, plan, "cpu", tables=TABLES))
        for request in range(2):
            with res.following_calls(), torch.no_grad():
                out = call()
            measured = res.finish_request()
            assert torch.equal(out, reference), f"{mode.value}: output differs from the plain pipeline"
            assert measured.peak_device_bytes == plan.peak_device_bytes, (mode.value, request)
            assert measured.bytes_moved == plan.bytes_moved_per_request, (mode.value, request)
        for name, c in res.components.items():
            if c.streamer is not None:  # the engine's own formula and meter agree with the plan too
                predicted = plan.component(name).prediction.in_use_bytes
                assert predicted == c.streamer.predicted_peak_bytes() == c.streamer.meter.peak_bytes, name
                # and the pinned staging buffers its pageable and mapped layers copy through
                assert plan.component(name).prediction.staging_bytes == c.streamer.staging_bytes, name
        assert plan.staging_bytes == sum(c.streamer.staging_bytes for c in res.components.values()
                                         if c.streamer is not None), mode.value
        seen.add(tuple(c.strategy for c in plan.components))
        res.remove()  # untracks its meters: the next mode's headroom starts from zero
    assert staged > 0, "the no-lease plan staged its pageable layers"
    assert len(seen) >= 2, "the modes should exercise more than one strategy mix"


def test_the_report_shows_parked_weights_and_pinned_layers_of_each_component(cpu_capacity, remove_after):
    cpu_capacity(10_000)
    models = toys()
    res = remove_after(PipelineResidency.apply(models, toy_plan(10_000), "cpu"))
    with torch.no_grad(), res.stage(["a"]):
        models["a"](torch.randn(1, 16))
    report = res.report()
    a = report.component("a")
    fresh = Toy(0)
    non_layer = sum(p.numel() * 4 for m in (fresh.embed, fresh.head) for p in m.parameters())
    assert a.parked_bytes == non_layer and a.device_bytes == 0
    assert a.host_pinned_bytes == sum(layer.nbytes for layer in res.components["a"].streamer.layers)
    assert dict(a.layer_tiers)["pinned"] == 4
    assert report.to_json()["totals"]["parked_bytes"] == 2 * non_layer


def _layouts(model):
    from offload_core.layout import layer_parameters, plan_layer_layout

    return [plan_layer_layout(str(i), [(n, p) for n, p in layer_parameters(block)]) for i, block in enumerate(model.blocks)]


def _staging_bytes(model) -> int:
    """The engine's staging buffers for a toy whose layers all stage: buffers.staging_bytes of its blocks."""
    from offload_core.buffers import staging_bytes

    return staging_bytes(layout.flat_bytes for layout in _layouts(model))


def _padding_bytes(model) -> int:
    """What consolidating a toy's (anonymous) layers into aligned flat buffers adds."""
    return sum(layout.nbytes - layout.tensor_bytes for layout in _layouts(model))


def test_a_host_budget_caps_the_tiers_and_the_plan_stays_bitwise(cpu_capacity, remove_after):
    cpu_capacity(1 << 30)
    plan = toy_plan(1 << 30)
    x = torch.randn(3, 16)
    expected = {n: m(x) for n, m in toys().items()}
    models = toys()
    # The toys' weights are anonymous (made in memory): that floor, plus the cheapest hosting on top:
    # consolidating every layer costs its padding (8 x 448 B), less than leaving them and staging
    # their copies (two 1,536 B buffers per component).
    padding = sum(_padding_bytes(m) for m in models.values())
    assert padding < sum(_staging_bytes(m) for m in models.values())
    floor = sum(p.numel() * 4 for m in models.values() for p in m.blocks.parameters()) + padding
    node = InProcessLedger(1 << 30)
    residency = remove_after(
        PipelineResidency.apply(models, plan, "cpu", node, owner="capped", host_budget_bytes=floor))
    assert node.leased() == residency.host_leased_bytes() == padding, "no room past the floor: only padding leased"
    for name, model in models.items():
        with residency.stage([name]):
            assert torch.equal(model(x), expected[name])
    tiers = {t for c in residency.plan.components for _, t in c.hosting}
    assert tiers == {HostingTier.PINNED}, "at the floor, the cheapest: every layer in its flat buffer"
    assert all(c.streamer.staging_bytes == 0 for c in residency.components.values())
    residency.remove()


def test_a_host_budget_below_every_plan_fails_at_start_naming_the_smallest_that_works(cpu_capacity):
    from offload_core.host.budget_cap import BudgetTooSmall

    cpu_capacity(1 << 30)
    models = toys()
    floor = sum(p.numel() * 4 for m in models.values() for p in m.blocks.parameters())
    floor += sum(_padding_bytes(m) for m in models.values())
    with pytest.raises(BudgetTooSmall, match=f"smallest that works is .* \\({floor} B\\)") as caught:
        PipelineResidency.apply(models, toy_plan(1 << 30), "cpu", InProcessLedger(1 << 30), owner="tiny",
                                host_budget_bytes=floor - 1)
    assert caught.value.smallest == floor and caught.value.budget == floor - 1
