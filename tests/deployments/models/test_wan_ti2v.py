"""Wan2.2 TI2V-5B: a request with a reference image and one without share each step's forward, and
each comes out as it does alone (the image request: its first latent frame is the image's)."""
from __future__ import annotations

import dataclasses
import io

import torch
from PIL import Image

from deployments.models import families
from deployments.replica.batching import BatchingConfig, StepBatch
from deployments.wire.spec import GenerationSpec, PipelineStage
from zoo.wan22 import ensure_tiny_wan22_ti2v

CPU, F32 = torch.device("cpu"), torch.float32
ALONE_ATOL = 1e-4  # batched kernels' summation order (the conformance suite's bound)


def _png() -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (32, 32), (200, 40, 30)).save(out, format="PNG")
    return out.getvalue()


def test_image_and_text_requests_share_forwards_and_each_matches_its_run_alone():
    facts = families.read_family_traits(ensure_tiny_wan22_ti2v())
    pipes = {s: families.load_stage_pipeline(facts, s, F32) for s in PipelineStage}
    text = GenerationSpec("t", "a red fox", "blurry", 32, 32, 5, 3, 5.0, 1, 1)
    image = GenerationSpec("i", "a blue bird", "blurry", 32, 32, 5, 3, 5.0, 2, 1, _png())
    encoded = {}
    for spec in (text, image):
        prompt = families.encode(pipes[PipelineStage.ENCODE], facts, spec, CPU)
        condition = families.condition(pipes[PipelineStage.DECODE], facts, spec, CPU)
        encoded[spec.request_id] = dataclasses.replace(prompt, image_condition=condition)
    assert encoded["t"].image_condition is None and encoded["i"].image_condition.shape[2] == 1  # one latent frame

    stepper = families.adapter_for(facts).stepper(pipes[PipelineStage.DENOISE], facts, CPU)
    batch = StepBatch(stepper, BatchingConfig(max_batch=2))
    futures = {s.request_id: batch.submit(stepper.start(encoded[s.request_id], s)) for s in (text, image)}
    while not batch.idle:
        batch.step()
    assert batch.forwards == 3  # one forward per step for both requests
    for spec in (text, image):
        alone = families.denoise(pipes[PipelineStage.DENOISE], facts, encoded[spec.request_id], spec, CPU)
        torch.testing.assert_close(futures[spec.request_id].result(), alone, rtol=0, atol=ALONE_ATOL)
    # The image request's first latent frame is the image's latents, put back after the last step.
    assert torch.equal(futures["i"].result()[:, :, :1], encoded["i"].image_condition)
