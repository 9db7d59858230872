"""A request with LoRA adapter X through the Denoiser replica (unmerged, per row, on its streamed
transformer) gives the image diffusers' own plain pipeline gives with ``load_lora_weights`` +
``set_adapters`` (PEFT, unfused), within 1 level of the delivered 8-bit pixels; for the tiny Wan
and FLUX zoo models and a Qwen-Image-Edit edit, with random rank-4 adapters the test writes in the
diffusers/PEFT format."""
from __future__ import annotations

import asyncio

import pytest
import torch

from deployments.app import stage_configs
from deployments.models import families
from deployments.replica.stages import Denoiser
from deployments.wire.spec import GenerationSpec, PipelineStage, StageOutput, StageStats
from tests.deployments.conftest import tiny_args
from tests.deployments.models.in_context import a_photo
from tests.deployments.models.lora_files import write_adapter
from zoo.tiny import ensure_tiny_flux, ensure_tiny_wan
from zoo.tiny_families import ensure_tiny_qwen_image_edit

F32, CPU = torch.float32, torch.device("cpu")
ENCODE, DENOISE, DECODE = PipelineStage.ENCODE, PipelineStage.DENOISE, PipelineStage.DECODE
SCALE = 0.8  # not 1: the request's scale must reach the low-rank term as set_adapters' weight does


def _levels(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest difference in the delivered 8-bit pixels."""
    return ((a * 255).round() - (b * 255).round()).abs().max().item()


def _served(facts, spec: GenerationSpec, config) -> torch.Tensor:
    """``spec`` through the encoder stage's pipeline, the Denoiser replica (in process) and the decoder's (its
    condition too, for a family that takes the image in context)."""
    encoded = families.encode(families.load_stage_pipeline(facts, ENCODE, F32), facts, spec, CPU)
    condition = families.condition(families.load_stage_pipeline(facts, DECODE, F32), facts, spec, CPU)
    denoiser = Denoiser.func_or_class(config)

    def output(value):
        return StageOutput(value, StageStats("encode", "test", 0.0, 0, 0))

    async def denoise():
        items = [item async for item in denoiser.denoise(
            output(encoded.packed()), spec, progress=False, condition=None if condition is None else output(condition))]
        return items[-1].value

    try:
        latents = asyncio.run(denoise())
    finally:
        denoiser.batcher.close()
        denoiser.worker.close()
    return families.decode(families.load_stage_pipeline(facts, DECODE, F32), facts, latents, spec, CPU)


@pytest.mark.parametrize("folder, strength, image", [(ensure_tiny_wan, 4.0, None), (ensure_tiny_flux, 0.5, None),
                                                     (ensure_tiny_qwen_image_edit, 4.0, a_photo(48, 32))],
                         ids=["wan", "flux", "qwen-image-edit"])
def test_a_request_with_an_adapter_is_diffusers_load_lora_weights_within_one_level(folder, strength, image, tmp_path):
    """Qwen-Image-Edit: an edit with an adapter (its users' Lightning adapters are LoRAs of its transformer)."""
    facts = families.read_family_traits(folder())
    spec = GenerationSpec("x", "a red fox", None, 16, 16, 1, 3, facts.default_guidance, 7, 1, image, lora="x",
                          lora_scale=SCALE)
    pipe = families.load_full_pipeline(facts, F32)
    path = write_adapter(pipe.transformer, tmp_path / "x.safetensors", rank=4, seed=5, strength=strength)
    base = families.reference_frames(pipe, facts, spec)
    pipe.load_lora_weights(str(path), adapter_name="x")
    pipe.set_adapters(["x"], [SCALE])
    reference = families.reference_frames(pipe, facts, spec)
    assert _levels(reference, base) >= 4, "the adapter changes the image well beyond rounding"

    args = tiny_args(model_path=facts.folder, lora_adapters=[
        {"name": "x", "path": str(path), "scale": 1.0, "families": [facts.family.value]}])
    served = _served(facts, spec, stage_configs(args, facts)[DENOISE])
    assert served.shape == reference.shape
    assert _levels(served, reference) <= 1, f"{facts.family.value}: {_levels(served, reference)} levels off diffusers"
