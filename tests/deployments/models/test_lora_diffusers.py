"""A request with LoRA adapter X through the Denoiser replica (unmerged, per row, on its streamed
transformer) gives the image diffusers' own plain pipeline gives with ``load_lora_weights`` +
``set_adapters`` (PEFT, unfused), within 1 level of the delivered 8-bit pixels; for the tiny Wan
and FLUX zoo models, with random rank-4 adapters the test writes in the diffusers/PEFT format."""
from __future__ import annotations

import asyncio

import pytest
import torch

from deployments.app import stage_configs
from deployments.models import families
from deployments.replica.stages import Denoiser
from deployments.wire.spec import GenerationSpec, PipelineStage, StageOutput, StageStats
from tests.deployments.conftest import tiny_args
from tests.deployments.models.lora_files import write_adapter
from zoo.tiny import ensure_tiny_flux, ensure_tiny_wan

F32, CPU = torch.float32, torch.device("cpu")
ENCODE, DENOISE, DECODE = PipelineStage.ENCODE, PipelineStage.DENOISE, PipelineStage.DECODE
SCALE = 0.8  # not 1: the request's scale must reach the low-rank term as set_adapters' weight does


def _levels(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest difference in the delivered 8-bit pixels."""
    return ((a * 255).round() - (b * 255).round()).abs().max().item()


def _served(facts, spec: GenerationSpec, config) -> torch.Tensor:
    """``spec`` through the encoder stage's pipeline, the Denoiser replica (in process) and the decoder's."""
    encoded = families.encode(families.load_stage_pipeline(facts, ENCODE, F32), facts, spec, CPU)
    denoiser = Denoiser.func_or_class(config)

    async def denoise():
        items = [item async for item in denoiser.denoise(
            StageOutput(encoded.packed(), StageStats("encode", "test", 0.0, 0, 0)), spec, progress=False)]
        return items[-1].value

    try:
        latents = asyncio.run(denoise())
    finally:
        denoiser.batcher.close()
        denoiser.worker.close()
    return families.decode(families.load_stage_pipeline(facts, DECODE, F32), facts, latents, spec, CPU)


@pytest.mark.parametrize("folder, strength", [(ensure_tiny_wan, 4.0), (ensure_tiny_flux, 0.5)], ids=["wan", "flux"])
def test_a_request_with_an_adapter_is_diffusers_load_lora_weights_within_one_level(folder, strength, tmp_path):
    facts = families.read_family_traits(folder())
    spec = GenerationSpec("x", "a red fox", None, 16, 16, 1, 3, facts.default_guidance, 7, 1, lora="x",
                          lora_scale=SCALE)
    pipe = families.load_full_pipeline(facts, F32)
    path = write_adapter(pipe.transformer, tmp_path / "x.safetensors", rank=4, seed=5, strength=strength)
    base = families.reference_frames(pipe, facts, spec)
    pipe.load_lora_weights(str(path), adapter_name="x")
    pipe.set_adapters(["x"], [SCALE])
    reference = families.reference_frames(pipe, facts, spec)
    assert _levels(reference, base) >= 4, "the adapter changes the image well beyond rounding"

    args = tiny_args(tiny_family=facts.family.value, lora_adapters=[
        {"name": "x", "path": str(path), "scale": 1.0, "families": [facts.family.value]}])
    served = _served(facts, spec, stage_configs(args, facts)[DENOISE])
    assert served.shape == reference.shape
    assert _levels(served, reference) <= 1, f"{facts.family.value}: {_levels(served, reference)} levels off diffusers"
