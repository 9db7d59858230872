"""HunyuanVideo 1.5 image-to-video (deployments/models/hunyuan_video15_i2v.py) beyond the conformance suite's
square default request: the image fitted to another size and aspect as the pipeline fits it, the image's
part in the result, what the Denoiser refuses, and the step-distilled (mean-flow) transformer's second timestep.

In-process on the tiny zoo's HunyuanVideo15ImageToVideoPipeline folder (SigLIP 4 tokens, target_size 32).
"""
from __future__ import annotations

import dataclasses
import io

import pytest
import torch
from PIL import Image

from deployments.models import families
from deployments.models.registry import adapter_for
from deployments.replica.batching import BatchingConfig, StepBatch
from deployments.wire.spec import GenerationSpec, PipelineStage
from zoo import tiny_families

CPU, F32 = torch.device("cpu"), torch.float32
ENCODE, DENOISE, DECODE = PipelineStage.ENCODE, PipelineStage.DENOISE, PipelineStage.DECODE


def a_photo(width: int, height: int) -> bytes:
    """An image with structure, so a crop or an ignored image would show."""
    image = Image.new("RGB", (width, height))
    image.putdata([(7 * x % 256, 11 * y % 256, 90) for y in range(height) for x in range(width)])
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


@pytest.fixture(scope="module")
def i2v():
    facts = families.read_family_traits(tiny_families.ensure_tiny_hunyuan15_i2v())
    pipes = {s: families.load_stage_pipeline(facts, s, F32) for s in PipelineStage}
    return facts, pipes, families.load_full_pipeline(facts, F32)


def _encoded(facts, pipes, spec):
    encoded = families.encode(pipes[ENCODE], facts, spec, CPU)
    return dataclasses.replace(encoded, image_condition=families.condition(pipes[DECODE], facts, spec, CPU))


def _batched(facts, pipes, spec) -> torch.Tensor:
    stepper = adapter_for(facts).stepper(pipes[DENOISE], facts, CPU)
    batch = StepBatch(stepper, BatchingConfig(max_batch=1))
    future = batch.submit(stepper.start(_encoded(facts, pipes, spec), spec))
    while not batch.idle:
        batch.step()
    return families.decode(pipes[DECODE], facts, future.result(), spec, CPU)


def test_an_image_of_another_aspect_is_cropped_to_the_asked_size_as_the_pipeline_crops_it(i2v):
    facts, pipes, full = i2v
    spec = GenerationSpec("w", "a red fox", None, 16, 32, 5, 2, 1.0, 4, 1, a_photo(50, 20))  # 2:1 from 5:2
    staged = _batched(facts, pipes, spec)
    assert staged.shape == (1, 5, 16, 32, 3)
    assert torch.equal(staged, families.reference_frames(full, facts, spec))
    other = dataclasses.replace(spec, reference_image=a_photo(20, 50))
    assert not torch.equal(_batched(facts, pipes, other), staged), "the image conditions the video"


def test_a_guided_request_through_the_step_batcher_is_the_pipeline_within_one_level(i2v):
    facts, pipes, full = i2v
    spec = GenerationSpec("g", "a red fox", "fog", 32, 32, 5, 2, facts.default_guidance, 5, 1, a_photo(40, 40))
    frames, reference = _batched(facts, pipes, spec), families.reference_frames(full, facts, spec)
    levels = ((frames * 255).round() - (reference * 255).round()).abs().max().item()
    assert spec.guidance_scale > 1 and levels <= 1, levels


def test_the_denoiser_refuses_a_request_without_the_images_condition(i2v):
    facts, pipes, _ = i2v
    spec = GenerationSpec("c", "a red fox", None, 16, 16, 5, 2, 1.0, 4, 1, a_photo(16, 16))
    encoded = families.encode(pipes[ENCODE], facts, spec, CPU)  # the decoder stage's condition left out
    with pytest.raises(ValueError, match="request c: image-to-video needs the reference image's condition"):
        adapter_for(facts).stepper(pipes[DENOISE], facts, CPU).start(encoded, spec)


def test_a_step_distilled_meanflow_transformer_gets_the_next_timestep_and_is_the_pipeline(tmp_path):
    """The pipeline passes ``timestep_r`` (the next step's timestep, 0 at the last) to a use_meanflow
    transformer; without it the embedding is another and so is the video."""
    tiny_families.build_hunyuan15_i2v(tmp_path, meanflow=True)
    facts = families.read_family_traits(tmp_path)
    pipes = {s: families.load_stage_pipeline(facts, s, F32) for s in PipelineStage}
    spec = GenerationSpec("m", "a red fox", None, 32, 32, 5, 3, 1.0, 6, 1, a_photo(32, 32))
    reference = families.reference_frames(families.load_full_pipeline(facts, F32), facts, spec)
    staged = _batched(facts, pipes, spec)
    assert torch.equal(staged, reference)
    latents = families.denoise(pipes[DENOISE], facts, _encoded(facts, pipes, spec), spec, CPU)
    assert torch.equal(families.decode(pipes[DECODE], facts, latents, spec, CPU), reference)
    stepper = adapter_for(facts).stepper(pipes[DENOISE], facts, CPU)
    stepper.extra_inputs = lambda batch, dtype: {}  # as a stepper that ignored use_meanflow would run
    batch = StepBatch(stepper, BatchingConfig(max_batch=1))
    future = batch.submit(stepper.start(_encoded(facts, pipes, spec), spec))
    while not batch.idle:
        batch.step()
    assert not torch.equal(families.decode(pipes[DECODE], facts, future.result(), spec, CPU), reference)
