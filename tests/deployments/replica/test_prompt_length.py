"""The Denoiser prices an unpadded prompt by its length (Qwen-Image pads none: deployments/models/qwen_image.py):
it reads the encoder's token count into the request's spec before it admits and leases, and a request joins a
busy period's step batch only if the batch's forward, every prompt padded to the longest, fits what that period
leased. In process: the stage classes themselves on the tiny Qwen-Image folder."""
from __future__ import annotations

import asyncio
import dataclasses

import pytest

from deployments.app import stage_configs
from deployments.models.families import read_family_traits
from deployments.replica.stages import Denoiser, TextEncoder
from deployments.wire.spec import GenerationSpec, PipelineStage
from tests.deployments.conftest import tiny_args
from zoo.tiny_families import ensure_tiny_qwen_image

SHORT = GenerationSpec("short", "a fox", "", 16, 16, 1, 2, 4.0, 0, 1)  # guided: true CFG with a negative prompt
LONG = dataclasses.replace(SHORT, request_id="long", prompt=" ".join(["a fox in the snow"] * 10))


@pytest.fixture(scope="module")
def served():
    """(encoder, denoiser, {request id: (encoded, the spec the Denoiser ran it with)}) for SHORT and LONG."""
    facts = read_family_traits(ensure_tiny_qwen_image())
    configs = stage_configs(tiny_args(model_path=facts.folder), facts)
    encoder = TextEncoder.func_or_class(configs[PipelineStage.ENCODE])
    denoiser = Denoiser.func_or_class(configs[PipelineStage.DENOISE])

    async def run(spec):
        encoded = await encoder.encode(spec)
        items = [item async for item in denoiser.denoise(encoded, spec, progress=False)]
        assert items[-1].value.shape[0] == spec.n
        return encoded, denoiser.last_spec

    try:
        yield encoder, denoiser, {spec.request_id: asyncio.run(run(spec)) for spec in (SHORT, LONG)}
    finally:
        encoder.thread.close()
        encoder.worker.close()
        denoiser.batcher.close()
        denoiser.worker.close()


def test_the_denoiser_counts_the_encoders_tokens_before_it_leases(served):
    _, denoiser, runs = served
    for encoded, spec in runs.values():
        value = encoded.value.unpacked()
        longest = max(value.prompt_embeds.shape[1], value.negative_prompt_embeds.shape[1])
        assert spec.text_tokens == longest
    short, long = runs["short"][1], runs["long"][1]
    # The tiny tokenizer is byte-level: the template's tail leaves about 100 tokens of the shortest prompt.
    assert long.text_tokens > short.text_tokens > 64
    worker = denoiser.worker
    assert worker.activation_bytes(long) > worker.activation_bytes(short) > worker.activation_bytes(SHORT), (
        "each prompt is priced by its own tokens, not the calibration stand-in's 64")


def test_a_longer_prompt_waits_for_a_busy_period_leased_for_shorter_ones(served):
    _, denoiser, runs = served
    (short_encoded, short), (long_encoded, long) = runs["short"], runs["long"]
    first = denoiser.stepper.start(short_encoded.value.unpacked(), short)
    again = denoiser.stepper.start(short_encoded.value.unpacked(), dataclasses.replace(short, request_id="again"))
    longer = denoiser.stepper.start(long_encoded.value.unpacked(), long)
    denoiser._leased_activation_bytes = denoiser.worker.activation_bytes(short, batch=2)
    assert denoiser._fits([first, again])
    assert not denoiser._fits([first, longer]), "the forward pads the short prompt's rows to the long one's"
    denoiser._leased_activation_bytes = denoiser.worker.activation_bytes(long, batch=2)
    assert denoiser._fits([first, longer])
