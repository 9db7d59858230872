"""A stage failure caused by the request reaches the ingress as a 4xx naming the field, not a 500; a
decoder that makes NaN says so instead of answering a black image."""
from __future__ import annotations

import asyncio
import pickle

import pytest
import torch

from deployments.app import stage_configs
from deployments.models import activation_features
from deployments.models.families import read_family_traits
from deployments.replica.stages import TextEncoder, VaeDecoder, finite_frames
from deployments.wire.spec import (
    GenerationSpec,
    NonFiniteOutput,
    PipelineStage,
    RequestRejected,
    StageOutput,
    StageStats,
)
from tests.deployments.conftest import tiny_args
from zoo.tiny import ensure_tiny_flux, ensure_tiny_wan


def test_text_the_tokenizer_cannot_take_is_refused_naming_the_prompt():
    # Flux: diffusers' Wan pipelines clean every prompt with ftfy (installed for Wan image-to-video),
    # which turns a lone surrogate into U+FFFD before the tokenizer sees it; Flux's tokenizers get it raw.
    config = stage_configs(tiny_args(tiny_family="flux"), read_family_traits(ensure_tiny_flux()))[PipelineStage.ENCODE]
    encoder = TextEncoder.func_or_class(config)
    try:
        # Validation refuses lone surrogates; this reaches the stage as a client bypassing it would.
        with pytest.raises(RequestRejected) as caught:
            asyncio.run(encoder.encode(GenerationSpec("r", "a \ud800 cat", None, 16, 16, 1, 2, 1.0, 0, 1)))
        assert (caught.value.param, caught.value.status) == ("prompt", 400)
        assert not encoder.worker.busy, "the refused call kept the replica"
    finally:
        encoder.thread.close()
        encoder.worker.close()


def test_a_request_rejection_survives_pickling_with_its_field():
    again = pickle.loads(pickle.dumps(RequestRejected("size", "too big", 413)))
    assert (again.param, again.message, again.status) == ("size", "too big", 413)


def test_nan_latents_are_a_non_finite_output_counting_the_values_not_a_black_image():
    config = stage_configs(tiny_args(), read_family_traits(ensure_tiny_wan()))[PipelineStage.DECODE]
    decoder = VaeDecoder.func_or_class(config)
    spec, stats = GenerationSpec("r", "a cat", None, 16, 16, 5, 2, 1.0, 0, 1), StageStats("denoise", "d#1", 0.1, 1, 1)
    latents = activation_features.stage_input(decoder.worker.pipe, config.facts, PipelineStage.DECODE, spec)
    try:
        frames = asyncio.run(decoder.decode(StageOutput(latents, stats), spec)).value
        assert frames.shape == (1, 5, 16, 16, 3) and torch.isfinite(frames).all()
        latents[..., 0, 0] = float("nan")  # one latent pixel: the VAE's convolutions spread it
        with pytest.raises(NonFiniteOutput, match=r"the decoder made \d+ of 3840 output values NaN or infinite in "
                                                  r"float32$"):
            asyncio.run(decoder.decode(StageOutput(latents, stats), spec))
        assert not decoder.worker.busy, "the failed call kept the replica"
    finally:
        decoder.thread.close()
        decoder.worker.close()


def test_float16s_non_finite_output_names_bfloat16_and_survives_pickling():
    frames = torch.zeros(1, 1, 2, 2, 3)
    assert finite_frames(frames, "float16") is frames
    frames[0, 0, 0, 0, 0] = float("inf")
    with pytest.raises(NonFiniteOutput) as caught:
        finite_frames(frames, "float16")
    again = pickle.loads(pickle.dumps(caught.value))
    assert str(again) == ("the decoder made 1 of 12 output values NaN or infinite in float16 (float16 overflows "
                          "where bfloat16 does not: serve with dtype bfloat16)")


def test_an_edit_that_reaches_the_denoiser_without_its_sources_latents_fails_rather_than_generating_from_noise():
    # The remix's first drive asked the decoder for a condition only for a reference image: the edit ran as a
    # text-to-video request from noise, with 200 OK. The Denoiser now refuses the mismatch either way.
    from deployments.replica.stages import Denoiser
    from deployments.wire.spec import EditRule, EncodedPrompt

    config = stage_configs(tiny_args(), read_family_traits(ensure_tiny_wan()))[PipelineStage.DENOISE]
    denoiser = Denoiser.func_or_class(config)
    spec = GenerationSpec("r", "a cat", None, 16, 16, 5, 2, 1.0, 0, 1, strength=0.6, edit_rule=EditRule.VIDEO2VIDEO,
                          reference_video=b"mp4")
    encoded = StageOutput(EncodedPrompt(torch.zeros(1, 512, 32)), StageStats("encode", "e#1", 0.1, 0, 0))

    async def drain(stream):
        return [item async for item in stream]

    try:
        with pytest.raises(RuntimeError, match="an edit needs its source's latents"):
            asyncio.run(drain(denoiser.denoise(encoded, spec)))
        assert denoiser.in_flight == {} and not denoiser.worker.busy
    finally:
        denoiser.batcher.close()
        denoiser.worker.close()
