"""A stage's components run under the streaming engine as its offload mode says, bitwise unchanged."""
from __future__ import annotations

import pytest
import torch

from deployments import families
from deployments.offload import StageResidency, Strategy
from deployments.spec import GenerationSpec, OffloadMode
from zoo.tiny import ensure_tiny_wan

CPU = torch.device("cpu")
SPEC = GenerationSpec("r", "a cat", None, 16, 16, 1, 2, 5.0, 3, 1)


@pytest.fixture(scope="module")
def facts():
    return families.read_family_facts(ensure_tiny_wan())


def _denoise_under(facts, mode):
    encoded = families.encode(families.load_stage_pipeline(facts, "encode", torch.float32), facts, SPEC, CPU)
    pipe = families.load_stage_pipeline(facts, "denoise", torch.float32)
    residency = StageResidency(families.stage_modules(pipe, facts, "denoise"), mode, CPU)
    residency.prepare_for_use()
    latents = families.denoise(pipe, facts, encoded, SPEC)
    residency.finish_use()
    return latents, residency, encoded


@pytest.mark.parametrize("mode, resident_layers", [(OffloadMode.MEMORY, 0), (OffloadMode.BALANCED, 2),
                                                   (OffloadMode.SPEED, 4)])
def test_each_offload_mode_streams_the_denoiser_and_keeps_its_output_bitwise(facts, mode, resident_layers):
    latents, residency, encoded = _denoise_under(facts, mode)
    plain = families.denoise(families.load_stage_pipeline(facts, "denoise", torch.float32), facts, encoded, SPEC)
    assert torch.equal(latents, plain), f"{mode.value} offload changed the denoiser's latents"
    (placement,) = residency.placements()
    assert (placement.strategy, placement.layers, placement.resident_layers) == \
        (Strategy.STREAMED, 4, resident_layers)
    residency.remove()


def test_a_memory_mode_call_streams_every_layer_each_step_and_the_report_counts_host_bytes(facts):
    latents, residency, _ = _denoise_under(facts, OffloadMode.MEMORY)
    weights = residency.report().component("transformer")
    layer_bytes = weights.host_pageable_bytes  # MEMORY hosts all 4 equal layers pageable
    assert dict(weights.layer_tiers)["pageable"] == 4 and layer_bytes > 0
    # guidance 5.0 > 1: two transformer passes per step x 2 steps = 16 layer copies, plus the one
    # layer the depth-1 ring prefetches ahead for the next use.
    assert residency.bytes_streamed() in (16 * layer_bytes // 4, 17 * layer_bytes // 4)
    assert 0 < residency.device_peak_bytes() <= residency.predicted_peak_bytes()
    residency.remove()
