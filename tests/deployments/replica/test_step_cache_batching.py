"""The step cache under step batching: each request decides alone, a batch that all skips streams no later block."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from deployments.models import families
from deployments.models.step_cache import CACHE_ATTRIBUTE
from deployments.models.steppers import stepper_for
from deployments.replica.batching import BatchingConfig, StepBatch
from deployments.wire.spec import GenerationSpec, PipelineStage
from offload_core import StreamingConfig, apply_layer_streaming
from zoo.tiny import ensure_tiny_flux, ensure_tiny_wan
from zoo.tiny_families import ensure_tiny_hunyuan15, ensure_tiny_qwen_image, ensure_tiny_sd3

F32, CPU = torch.float32, torch.device("cpu")
STEPS = 6


def _specs(guided: bool, folder=ensure_tiny_wan):
    facts = families.read_family_traits(folder())
    side, frames = facts.size_multiple, 1 + facts.temporal_factor if facts.supports_video else 1
    scale = 5.0 if guided else 3.5
    return [GenerationSpec("a", "a red fox", None, side, side, frames, STEPS, scale, 1, 1),
            GenerationSpec("b", "a blue bird", None, side, side, frames, STEPS, scale, 2, 1)]


# Every family whose stepper runs the step cache (Z-Image does not: tests/deployments/models/test_uncached_families.py),
# guided where the family guides with two branches in one forward (Flux is distilled: one).
CACHED_FAMILIES = [(ensure_tiny_wan, True), (ensure_tiny_flux, False), (ensure_tiny_sd3, True),
                   (ensure_tiny_qwen_image, True), (ensure_tiny_hunyuan15, True)]
CACHED_IDS = ["wan", "flux", "sd3", "qwen-image", "hunyuan-video-1.5"]


def _run(folder, specs, thresholds, remove_after):
    """Both requests from the first boundary, the transformer streamed at depth 1; (latents, requests, streamer)."""
    facts = families.read_family_traits(folder)
    encoder = families.load_stage_pipeline(facts, PipelineStage.ENCODE, F32)
    denoiser = families.load_stage_pipeline(facts, PipelineStage.DENOISE, F32)
    for param in denoiser.transformer.parameters():
        param.data = param.data.clone()
    streamer = remove_after(apply_layer_streaming(denoiser.transformer, CPU, StreamingConfig(prefetch_depth=1)))
    stepper = stepper_for(denoiser, facts, CPU)
    batch = StepBatch(stepper, BatchingConfig(max_batch=4), bytes_streamed=lambda: streamer.bytes_copied)
    requests = []
    for spec, threshold in zip(specs, thresholds):
        request = stepper.start(families.encode(encoder, facts, spec, CPU), spec)
        request.cache.threshold = threshold
        requests.append((request, batch.submit(request)))
    while not batch.idle:
        batch.step()
    return {r.spec.request_id: f.result() for r, f in requests}, [r for r, _ in requests], streamer, denoiser


@dataclasses.dataclass(frozen=True)
class PlainRun:
    """A run with the cache off (thresholds 0): its latents, what it streamed, whether a block was wrapped."""

    latents: dict[str, torch.Tensor]
    bytes_copied: int
    wrapped: bool


@pytest.fixture(scope="module")
def plain_run():
    """``plain_run(folder, guided)``: the cache-off run of a family, run once for the module: the tests
    that compare against it (each family's two, the all-skip one) read it, not a run of their own
    (the module: 15.4 -> 13.0 CPU-s; hunyuan-video-1.5's two tests 11.9 -> 9.6)."""
    runs: dict[tuple, PlainRun] = {}

    def get(folder, guided: bool) -> PlainRun:
        if (folder, guided) not in runs:
            streamers = []
            try:
                latents, _, streamer, denoiser = _run(folder(), _specs(guided, folder), (0.0, 0.0),
                                                      lambda s: streamers.append(s) or s)
                runs[folder, guided] = PlainRun(latents, streamer.bytes_copied,
                                                getattr(denoiser.transformer, CACHE_ATTRIBUTE, None) is not None)
            finally:
                for streamer in streamers:
                    streamer.remove()
        return runs[folder, guided]

    yield get
    runs.clear()


@pytest.mark.parametrize("folder, guided", CACHED_FAMILIES, ids=CACHED_IDS)
def test_threshold_zero_leaves_the_forward_alone_and_equal_bitwise(folder, guided, plain_run, remove_after):
    plain = plain_run(folder, guided)
    assert not plain.wrapped, "no block wrapped while the cache is off"
    again, requests, _, _ = _run(folder(), _specs(guided, folder), (0.0, 0.0), remove_after)
    assert all(torch.equal(again[k], plain.latents[k]) for k in plain.latents)
    assert [r.cache.skipped for r in requests] == [0, 0]


@pytest.mark.parametrize("folder, guided", CACHED_FAMILIES, ids=CACHED_IDS)
def test_one_request_skips_while_the_other_computes_on_the_sub_batch(folder, guided, plain_run, remove_after):
    plain = plain_run(folder, guided).latents
    # 1e9: every step after the first two (a residual to compare, a tail to reuse) skips.
    cached, requests, _, _ = _run(folder(), _specs(guided, folder), (1e9, 0.0), remove_after)
    skipper, computer = requests
    assert skipper.cache.skipped == STEPS - 1 and computer.cache.skipped == 0
    assert skipper.cache.decided == STEPS
    # The computing request ran its later blocks on a sub-batch of one: rounding only.
    torch.testing.assert_close(cached["b"], plain["b"], rtol=0, atol=1e-4)
    assert not torch.equal(cached["a"], plain["a"]), "the skipping request reused residuals: lossy"


def test_a_batch_that_all_skips_streams_only_its_first_block_and_the_next_window(plain_run, remove_after):
    specs = _specs(True)
    plain = plain_run(ensure_tiny_wan, True)
    _, requests, streamer, denoiser = _run(ensure_tiny_wan(), specs, (1e9, 1e9), remove_after)
    cache = getattr(denoiser.transformer, CACHE_ATTRIBUTE)
    assert cache.all_skipped == STEPS - 1 and [r.cache.skipped for r in requests] == [STEPS - 1] * 2
    per_layer = streamer.layers[0].layout.nbytes
    n = len(streamer.layers)
    # A skipped step copies block 0 and at most depth (1) layers wasted ahead of it, against n for a full step.
    assert streamer.bytes_copied <= plain.bytes_copied - (STEPS - 1) * (n - 2) * per_layer
    assert streamer.ring.wasted_copies <= STEPS - 1  # depth 1: at most one layer per decision
    assert dataclasses.asdict(requests[0].spec)["cache_threshold"] is None
