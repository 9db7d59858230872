"""A stage failure caused by the request reaches the ingress as a 4xx naming the field, not a 500."""
from __future__ import annotations

import asyncio
import pickle

import pytest

from deployments.app import stage_configs
from deployments.models.families import read_family_traits
from deployments.replica.stages import TextEncoder
from deployments.wire.spec import GenerationSpec, PipelineStage, RequestRejected
from tests.deployments.conftest import tiny_args
from zoo.tiny import ensure_tiny_flux


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
