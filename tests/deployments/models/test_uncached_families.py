"""A family whose stepper runs no step cache says so for each request that asked for one, and runs
every block: the result is bitwise the uncached one (never a silent, partial skip)."""
from __future__ import annotations

import logging

import torch

from deployments.models import families
from deployments.replica.batching import BatchingConfig, StepBatch
from deployments.wire.spec import GenerationSpec, PipelineStage
from zoo.tiny_families import ensure_tiny_zimage

CPU, F32 = torch.device("cpu"), torch.float32


def _denoise(stepper, encoded, spec, threshold):
    batch = StepBatch(stepper, BatchingConfig(max_batch=2))
    request = stepper.start(encoded, spec)
    request.cache.threshold = threshold  # as the Denoiser sets it (request, else the deployment's default)
    future = batch.submit(request)
    while not batch.idle:
        batch.step()
    return future.result()


def test_a_cache_threshold_on_a_family_without_a_step_cache_is_logged_once_and_every_block_runs(caplog):
    # Z-Image: its first block refines the image tokens alone and its last runs on image + caption tokens,
    # so the first block's residual has no place in the last block's output: every block runs.
    facts = families.read_family_traits(ensure_tiny_zimage())
    side = facts.size_multiple
    spec = GenerationSpec("r", "a red fox", None, side, side, 1, 3, 5.0, 1, 1)
    encoded = families.encode(families.load_stage_pipeline(facts, PipelineStage.ENCODE, F32), facts, spec, CPU)
    stepper = families.adapter_for(facts).stepper(families.load_stage_pipeline(facts, PipelineStage.DENOISE, F32),
                                                  facts, CPU)
    plain = _denoise(stepper, encoded, spec, 0.0)
    with caplog.at_level(logging.INFO, logger="deployments.models.steppers"):
        asked = _denoise(stepper, encoded, spec, 0.5)
    assert torch.equal(asked, plain)
    lines = [r.getMessage() for r in caplog.records if "cache_threshold" in r.getMessage()]
    assert lines == ["request r: cache_threshold 0.5 ignored: the step cache is not implemented for the z-image family; "
                     "every block runs each step"]
