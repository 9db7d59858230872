"""A stage's components run under the planner's plan for its mode, bitwise unchanged, as predicted."""
from __future__ import annotations

import pytest
import torch

from cluster.replica.ledger_view import ReplicaMemory
from deployments.models import families
from deployments.replica.stage_residency import StageResidency
from deployments.wire.spec import GenerationSpec, PipelineStage
from offload_core.host.maps import MapsSnapshot
from offload_core.planner.search import PerformanceMode
from offload_core.planner.strategy import Strategy
from offload_core.quant import WeightFormat, fake_quantize_
from zoo.tiny import ensure_tiny_wan

CPU = torch.device("cpu")
ENCODE, DENOISE = PipelineStage.ENCODE, PipelineStage.DENOISE
SPEC = GenerationSpec("r", "a cat", None, 16, 16, 1, 2, 5.0, 3, 1)
# 4 blocks of the tiny Wan transformer: small enough that capacity, not speed, decides.
CAPACITY = 64 * 1024 * 1024


@pytest.fixture(scope="module")
def facts():
    return families.read_family_traits(ensure_tiny_wan())


def _denoise_under(facts, mode, remove_after, capacity=CAPACITY, weights=WeightFormat.NATIVE):
    encoded = families.encode(families.load_stage_pipeline(facts, ENCODE, torch.float32), facts, SPEC, CPU)
    pipe = families.load_stage_pipeline(facts, DENOISE, torch.float32)
    memory = ReplicaMemory.open_local("test-denoise", CPU)
    uses = families.uses_per_request(facts, DENOISE, SPEC.steps, SPEC.guidance_scale)
    residency = remove_after(StageResidency(
        "denoise", families.stage_modules(pipe, facts, DENOISE), uses, mode, CPU,
        device_capacity=capacity, host_budget=memory.host_budget, owner="test-denoise", weights=weights))
    residency.prepare_for_use()
    latents = families.denoise(pipe, facts, encoded, SPEC, CPU)
    residency.finish_use()
    return latents, residency, encoded


def test_uses_per_request_count_guidance_passes():
    wan = families.read_family_traits(ensure_tiny_wan())
    assert families.uses_per_request(wan, DENOISE, 20, 5.0) == {"transformer": 40}
    assert families.uses_per_request(wan, DENOISE, 20, 1.0) == {"transformer": 20}
    # Step batching runs guidance's two branches in one forward: one use per step.
    assert families.uses_per_request(wan, DENOISE, 20, 5.0, batched=True) == {"transformer": 20}
    assert families.uses_per_request(wan, ENCODE, 20, 5.0) == {"text_encoder": 2}


@pytest.mark.parametrize("mode, strategy", [(PerformanceMode.MEMORY, Strategy.LAYERWISE),
                                            (PerformanceMode.SPEED, Strategy.RESIDENT)])
def test_each_mode_runs_its_plan_with_bitwise_output_and_the_predicted_peak(facts, mode, strategy, remove_after):
    latents, residency, encoded = _denoise_under(facts, mode, remove_after)
    plain_pipe = families.load_stage_pipeline(facts, DENOISE, torch.float32)
    plain = families.denoise(plain_pipe, facts, encoded, SPEC, CPU)
    assert torch.equal(latents, plain), f"{mode.value} offload changed the denoiser's latents"
    assert residency.plan.component("transformer").strategy is strategy
    assert residency.device_peak_bytes() == residency.predicted_peak_bytes(), "measured peak != planned peak"


def test_memory_mode_streams_every_layer_and_the_report_puts_them_on_the_host(facts, remove_after):
    _, residency, _ = _denoise_under(facts, PerformanceMode.MEMORY, remove_after)
    plan = residency.plan
    assert residency.bytes_streamed() == plan.bytes_moved_per_request > 0
    weights = residency.report().component("transformer")
    assert weights.host_bytes > 0 and sum(n for _, n in weights.layer_tiers) == 4


def test_a_device_too_small_for_speed_gets_a_streamed_auto_plan(facts, remove_after):
    # Room for the non-layer weights and two layer slots, not for all four blocks at once.
    _, residency, _ = _denoise_under(facts, PerformanceMode.AUTO, remove_after, capacity=200_000)
    assert residency.plan.component("transformer").strategy is Strategy.LAYERWISE
    assert residency.device_peak_bytes() <= 200_000


def test_a_host_budget_below_the_converted_weights_fails_at_start_naming_the_smallest(facts):
    from offload_core.host.budget_cap import BudgetTooSmall

    # float32 folder loaded as bfloat16: every layer weight is an anonymous copy whatever the plan.
    pipe = families.load_stage_pipeline(facts, DENOISE, torch.bfloat16)
    modules = families.stage_modules(pipe, facts, DENOISE)
    params = [p.data for p in modules["transformer"].blocks.parameters()]
    # diffusers keeps its _keep_in_fp32_modules mapped; everything else was copied out.
    layer_bytes = sum(p.numel() * p.element_size() for p in params) - MapsSnapshot.take().mapped_bytes(params)
    assert layer_bytes > 0
    # Plus the two pinned staging buffers (per dtype, the largest layer) its pageable layers copy through.
    from offload_core.buffers import staging_bytes
    from offload_core.layout import layer_parameters, plan_layer_layout

    staging = staging_bytes(plan_layer_layout(str(i), [(n, p.data) for n, p in layer_parameters(block)]).flat_bytes
                            for i, block in enumerate(modules["transformer"].blocks))
    memory = ReplicaMemory.open_local("test-budget", CPU)
    uses = families.uses_per_request(facts, DENOISE, SPEC.steps, SPEC.guidance_scale)
    with pytest.raises(BudgetTooSmall, match=f"smallest that works is .*\\({layer_bytes + staging} B\\)"):
        StageResidency("denoise", modules, uses, PerformanceMode.MEMORY, CPU, device_capacity=CAPACITY,
                       host_budget=memory.host_budget, owner="test-budget", host_budget_bytes=layer_bytes // 2)
    assert memory.host_budget.outstanding("test-budget") == (), "a refused start holds no lease"


def test_a_replica_within_its_host_budget_reports_budget_leased_and_used(facts):
    pipe = families.load_stage_pipeline(facts, DENOISE, torch.float32)
    memory = ReplicaMemory.open_local("test-budget-ok", CPU)
    uses = families.uses_per_request(facts, DENOISE, SPEC.steps, SPEC.guidance_scale)
    budget = 256 * 1024
    residency = StageResidency("denoise", families.stage_modules(pipe, facts, DENOISE), uses, PerformanceMode.MEMORY,
                               CPU, device_capacity=CAPACITY, host_budget=memory.host_budget, owner="test-budget-ok",
                               host_budget_bytes=budget)
    status = residency.host_status(residency.report())
    assert status.budget_bytes == budget and 0 < status.leased_bytes <= budget
    assert status.used_bytes >= status.leased_bytes, "what the lease paid for is held on the host"
    residency.remove()
    assert memory.host_budget.outstanding("test-budget-ok") == ()


def test_a_stage_left_to_the_fleet_plans_in_its_gpus_profile_within_its_limits(facts, remove_after):
    from cluster.fleet import profile_for_gpu
    from cluster.node import fake_gpus, probe_node

    # A replica that got an L4 (injected), computing on the CPU that stands in for it; 400 kB of device:
    # the whole tiny DiT (268 kB) fits, but not within the half BALANCED keeps for activations.
    node = probe_node(resources={"offload_fake_ram_gb": 8}, nvml_gpus=fake_gpus("L4", 1, "test"))
    memory = ReplicaMemory.open_local("test-fleet", "cuda:0", node=node)
    profile = profile_for_gpu(node.gpus[0])
    assert (profile.name, profile.mode, profile.prefetch_depth) == ("l4-a10g-24gb", "BALANCED", 2)
    encoded = families.encode(families.load_stage_pipeline(facts, ENCODE, torch.float32), facts, SPEC, CPU)
    pipe = families.load_stage_pipeline(facts, DENOISE, torch.float32)
    uses = families.uses_per_request(facts, DENOISE, SPEC.steps, SPEC.guidance_scale)
    residency = remove_after(StageResidency(
        "denoise", families.stage_modules(pipe, facts, DENOISE), uses, None, CPU, device_capacity=400_000,
        host_budget=memory.host_budget, owner="test-fleet", memory=memory))
    plan = residency.plan.component("transformer")
    assert residency.mode is PerformanceMode.BALANCED and residency.plan.device_name == "L4"
    assert plan.strategy is Strategy.LAYERWISE and plan.prefetch_depth == 2
    assert plan.resident_layers <= int(profile.max_resident_fraction * 4)
    residency.prepare_for_use()
    latents = families.denoise(pipe, facts, encoded, SPEC, CPU)
    residency.finish_use()
    plain = families.denoise(families.load_stage_pipeline(facts, DENOISE, torch.float32), facts, encoded, SPEC, CPU)
    assert torch.equal(latents, plain)
    assert residency.device_peak_bytes() == residency.predicted_peak_bytes()


def test_an_fp8_denoiser_streams_8bit_bytes_and_equals_the_fake_quantized_stage(facts, remove_after):
    native_latents, native, encoded = _denoise_under(facts, PerformanceMode.MEMORY, remove_after)
    latents, fp8, _ = _denoise_under(facts, PerformanceMode.MEMORY, remove_after, weights=WeightFormat.FP8)
    reference = families.load_stage_pipeline(facts, DENOISE, torch.float32)
    fake_quantize_(reference.transformer.blocks)
    assert torch.equal(latents, families.denoise(reference, facts, encoded, SPEC, CPU))
    assert not torch.equal(latents, native_latents), "the tiny Wan's linears are quantized: a lossy path"
    assert fp8.bytes_streamed() == fp8.plan.bytes_moved_per_request < native.bytes_streamed()
    assert fp8.device_peak_bytes() == fp8.predicted_peak_bytes()
    shown = fp8.report().component("transformer")
    assert shown.weights == "fp8" and shown.layer_host_bytes < shown.layer_native_bytes
