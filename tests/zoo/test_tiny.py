"""The tiny zoo folders load with the real diffusers pipelines and generate deterministically."""
from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch
from diffusers import FluxPipeline, WanPipeline
from safetensors import safe_open

from zoo.tiny import (
    UMT5_VOCAB_ROWS,
    WanSizes,
    build_wan,
    ensure_medium_wan,
    ensure_tiny_flux,
    ensure_tiny_wan,
)


@pytest.fixture(scope="module")
def wan():
    return WanPipeline.from_pretrained(ensure_tiny_wan())


@pytest.fixture(scope="module")
def flux():
    return FluxPipeline.from_pretrained(ensure_tiny_flux())


def _wan_frames(pipe, num_frames: int, seed: int = 0, prompt: str = "a red cat riding a horse") -> np.ndarray:
    return pipe(
        prompt, height=16, width=16, num_frames=num_frames, num_inference_steps=2,
        generator=torch.Generator().manual_seed(seed), output_type="np",
    ).frames


def test_tiny_wan_generates_the_same_image_twice_and_a_different_one_for_another_seed(wan):
    first, again, other = _wan_frames(wan, 1), _wan_frames(wan, 1), _wan_frames(wan, 1, seed=1)
    assert first.shape == (1, 1, 16, 16, 3)
    assert np.isfinite(first).all()
    assert np.array_equal(first, again), "same seed must give bitwise-equal frames"
    assert not np.array_equal(first, other), "the output must depend on the noise, not be constant"
    # ...and on the prompt, so an encoder that streams wrong weights shows up end to end.
    assert not np.array_equal(first, _wan_frames(wan, 1, prompt="a blue bird in the sky"))


def test_tiny_wan_generates_five_frame_video(wan):
    frames = _wan_frames(wan, 5)
    assert frames.shape == (1, 5, 16, 16, 3)
    assert np.array_equal(frames, _wan_frames(wan, 5))


def test_tiny_wan_text_encoder_keeps_umt5s_full_token_table(wan):
    table = wan.text_encoder.get_input_embeddings().weight
    assert table.shape == (UMT5_VOCAB_ROWS, 32) and table.dtype == torch.float32
    # On disk too: the planner reads sizes from the checkpoint header.
    path = ensure_tiny_wan() / "text_encoder" / "model.safetensors"
    with safe_open(str(path), framework="pt") as f:
        shapes = {k: f.get_slice(k).get_shape() for k in f.keys()}
    assert [UMT5_VOCAB_ROWS, 32] in shapes.values()


def test_tokenizer_ids_index_inside_every_token_table(wan, flux):
    prompt = "An astronaut riding a horse on the moon, 4k photo! (v2) #42 ~ {x}"
    pairs = [(wan.tokenizer, wan.text_encoder), (flux.tokenizer, flux.text_encoder), (flux.tokenizer_2, flux.text_encoder_2)]
    for tokenizer, encoder in pairs:
        ids = tokenizer(prompt).input_ids
        content = tokenizer(prompt, add_special_tokens=False).input_ids  # CLIP's unk is also its eos
        assert tokenizer.unk_token_id not in content, f"{type(tokenizer).__name__} fell back to unk on ASCII"
        assert max(ids) < encoder.get_input_embeddings().num_embeddings
        assert len(tokenizer) <= encoder.get_input_embeddings().num_embeddings


def test_layer_groups_have_the_block_counts_the_engine_tests_need(wan, flux):
    assert len(wan.transformer.blocks) >= 4
    assert len(wan.text_encoder.encoder.block) >= 2
    assert len(wan.vae.decoder.up_blocks) >= 2
    assert len(flux.transformer.transformer_blocks) >= 2
    assert len(flux.transformer.single_transformer_blocks) >= 2
    assert len(flux.text_encoder.encoder.layers) >= 2  # transformers 5 dropped the .text_model level
    assert len(flux.text_encoder_2.encoder.block) >= 2


@pytest.mark.parametrize("size", [16, 32])
def test_tiny_flux_generates_the_same_image_twice(flux, size):
    def run(seed, prompt="a blue bird"):
        return flux(
            prompt, height=size, width=size, num_inference_steps=2, max_sequence_length=32,
            generator=torch.Generator().manual_seed(seed), output_type="np",
        ).images

    first = run(0)
    assert first.shape == (1, size, size, 3) and np.isfinite(first).all()
    assert np.array_equal(first, run(0))
    assert not np.array_equal(first, run(1))
    assert not np.array_equal(first, run(0, prompt="a green tree"))


def _digests(folder):
    return {p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.rglob("*.safetensors")}


def test_rebuilding_the_recipe_gives_bitwise_identical_weights(tmp_path):
    build_wan(tmp_path, WanSizes())
    rebuilt, cached = _digests(tmp_path), _digests(ensure_tiny_wan())
    assert rebuilt.keys() == cached.keys() and len(cached) == 3
    assert rebuilt == cached, "the seeded recipe must reproduce the cached weights byte for byte"


def test_medium_wan_denoiser_is_a_few_hundred_megabytes_and_the_rest_stays_tiny():
    folder = ensure_medium_wan()

    def nbytes(component):
        total = 0
        for path in (folder / component).glob("*.safetensors"):
            with safe_open(str(path), framework="pt") as f:
                for key in f.keys():
                    t = f.get_slice(key)
                    total += int(np.prod(t.get_shape())) * torch.finfo(torch.float32).bits // 8
        return total

    assert 200e6 <= nbytes("transformer") <= 500e6
    assert nbytes("vae") < 10e6
    assert nbytes("text_encoder") < 40e6  # the 256384 x 32 fp32 table (32.8 MB) dominates
