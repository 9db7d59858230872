"""Wan2.2 A14B's experts in one Denoiser replica: one expert's working set on the device at a time."""
from __future__ import annotations

import pytest
import torch

from cluster.replica.ledger_view import ReplicaMemory
from deployments.models import families
from deployments.replica.stage_residency import StageResidency
from deployments.wire.spec import GenerationSpec, PipelineStage
from offload_core.planner.search import PerformanceMode
from zoo.wan22 import ensure_tiny_wan22_a14b

CPU = torch.device("cpu")
ENCODE, DENOISE = PipelineStage.ENCODE, PipelineStage.DENOISE
# 4 steps: 999, 900 on the high-noise expert, 750, 500 on the low-noise one.
SPEC = GenerationSpec("r", "a cat", None, 16, 16, 1, 4, 5.0, 3, 1)
CAPACITY = 64 * 1024 * 1024


@pytest.fixture(scope="module")
def facts():
    return families.read_family_traits(ensure_tiny_wan22_a14b())


def _denoise_under(facts, phases, remove_after):
    encoded = families.encode(families.load_stage_pipeline(facts, ENCODE, torch.float32), facts, SPEC, CPU)
    pipe = families.load_stage_pipeline(facts, DENOISE, torch.float32)
    memory = ReplicaMemory.open_local("test-experts", CPU)
    uses = families.uses_per_request(facts, DENOISE, SPEC.steps, SPEC.guidance_scale)
    residency = remove_after(StageResidency(
        "denoise", families.stage_modules(pipe, facts, DENOISE), uses, PerformanceMode.MEMORY, CPU,
        device_capacity=CAPACITY, host_budget=memory.host_budget, owner="test-experts", phases=phases))
    residency.prepare_for_use()
    latents = families.denoise(pipe, facts, encoded, SPEC, CPU)
    residency.finish_use()
    return latents, residency, encoded


def test_the_family_declares_one_phase_per_expert(facts):
    assert families.stage_phases(facts, DENOISE) == (("transformer",), ("transformer_2",))
    assert families.uses_per_request(facts, DENOISE, 4, 5.0) == {"transformer": 4, "transformer_2": 4}


def test_experts_switch_residency_at_the_boundary_and_peak_at_one_experts_working_set(facts, remove_after):
    latents, phased, encoded = _denoise_under(facts, families.stage_phases(facts, DENOISE), remove_after)
    plain = families.denoise(families.load_stage_pipeline(facts, DENOISE, torch.float32), facts, encoded, SPEC, CPU)
    assert torch.equal(latents, plain), "switching experts' residency changed the latents"
    assert [s.name for s in phased.plan.stages] == ["denoise:transformer", "denoise:transformer_2"]
    assert phased.device_peak_bytes() == phased.predicted_peak_bytes(), "measured peak != planned peak"
    _, together, _ = _denoise_under(facts, None, remove_after)  # both experts prepared for the whole call
    assert phased.device_peak_bytes() < together.device_peak_bytes()
    assert together.device_peak_bytes() == together.predicted_peak_bytes()
    # Each expert streamed its 4 blocks per use: 4 uses each (2 steps x 2 guidance branches).
    by_expert = phased.bytes_streamed_by_component()
    assert set(by_expert) == {"transformer", "transformer_2"} and all(n > 0 for n in by_expert.values())
    assert sum(by_expert.values()) == phased.bytes_streamed()
