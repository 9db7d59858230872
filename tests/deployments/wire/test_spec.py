"""What crosses Ray between the stages: the encoder's embeddings without their zero padding."""
from __future__ import annotations

import pickle

import torch

from deployments.models import families
from deployments.wire.spec import EncodedPrompt, GenerationSpec, PipelineStage
from zoo.tiny import ensure_tiny_wan

CPU = torch.device("cpu")


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32)


def test_wan_embeddings_cross_without_their_zero_padding_and_unpack_bit_for_bit():
    facts = families.read_family_traits(ensure_tiny_wan())
    pipe = families.load_stage_pipeline(facts, PipelineStage.ENCODE, torch.float32)
    spec = GenerationSpec("r", "a lighthouse at dawn", "blurry", 32, 32, 1, 2, 5.0, 0, 2)
    encoded = families.encode(pipe, facts, spec, CPU)
    packed = encoded.packed()
    assert encoded.prompt_embeds.shape[1] == packed.padded_tokens == 512
    assert 0 < packed.prompt_embeds.shape[1] < 32, "the prompt's few tokens, not the 512 padded ones"
    # What Ray pickles: a few KiB instead of 2 x 2 x 512 x 32 fp32 (under Ray's 100 KiB inline limit).
    assert len(pickle.dumps(packed)) < len(pickle.dumps(encoded)) / 10
    restored = packed.unpacked()
    for before, after in ((encoded.prompt_embeds, restored.prompt_embeds),
                          (encoded.negative_prompt_embeds, restored.negative_prompt_embeds)):
        assert torch.equal(_bits(before), _bits(after))


def test_a_negative_zero_row_is_data_and_an_unpadded_prompt_crosses_whole():
    embeds = torch.zeros(1, 8, 4)
    embeds[0, :2] = 1.0
    embeds[0, 4, 3] = -0.0  # equal to 0.0, but not the same bits: it must survive the round trip
    packed = EncodedPrompt(embeds).packed()
    assert packed.prompt_embeds.shape[1] == 5 and packed.padded_tokens == 8
    assert torch.equal(_bits(packed.unpacked().prompt_embeds), _bits(embeds))
    full = EncodedPrompt(torch.ones(1, 8, 4), pooled_prompt_embeds=torch.ones(1, 4))  # Flux: T5 has no zero rows
    assert full.packed() is full and full.unpacked() is full
