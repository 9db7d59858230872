"""A whole tiny pipeline (the zoo's Wan and FLUX) with adapter X on its streamed transformer gives the image
diffusers gives with ``pipe.load_lora_weights`` + ``set_adapters`` on the plain pipeline, within 1 pixel level."""
from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from offload_core.host.tier import HostingTier
from offload_core.lora import apply_lora, load_lora
from offload_core.streaming.engine import StreamingConfig, apply_layer_streaming
from tests.offload_core.lora.adapters import random_weights, save_diffusers

logger = logging.getLogger(__name__)
SCALE = 0.8


def _wan():
    from diffusers import WanPipeline

    from zoo.tiny import ensure_tiny_wan

    pipe = WanPipeline.from_pretrained(ensure_tiny_wan())

    def call():
        return pipe("a cat", negative_prompt="blurry", height=16, width=16, num_frames=5, num_inference_steps=2,
                    generator=torch.Generator().manual_seed(0), output_type="np").frames[0]
    return pipe, call


def _flux():
    from diffusers import FluxPipeline

    from zoo.tiny import ensure_tiny_flux

    pipe = FluxPipeline.from_pretrained(ensure_tiny_flux())

    def call():
        return pipe("a cat", height=32, width=32, num_inference_steps=2, max_sequence_length=16,
                    generator=torch.Generator().manual_seed(0), output_type="np").images[0]
    return pipe, call


def _levels(image: np.ndarray) -> np.ndarray:
    return np.round(np.clip(image, 0, 1) * 255).astype(np.int16)


# Wan's layers pinned; FLUX's left MAPPED on the checkpoint's file mapping (from_pretrained keeps them there).
@pytest.mark.parametrize("family,tier", [(_wan, HostingTier.PINNED), (_flux, HostingTier.MAPPED)],
                         ids=["wan-pinned", "flux-mapped"])
def test_a_pipeline_with_an_adapter_gives_diffusers_image_within_one_level(family, tier, tmp_path):
    reference, call_reference = family()
    path = save_diffusers(random_weights(reference.transformer, rank=4, seed=11), tmp_path / "x.safetensors")
    base = _levels(call_reference())
    reference.load_lora_weights(str(path), adapter_name="x")
    reference.set_adapters(["x"], [SCALE])
    want = _levels(call_reference())

    pipe, call = family()
    loras = apply_lora(pipe.transformer, "cpu", budget_bytes=1 << 24)
    loras.load(load_lora(path, "x"))
    groups = {f"{name}.{i}": tier for name, child in pipe.transformer.named_children()
              if isinstance(child, torch.nn.ModuleList) for i in range(len(child))}
    streamer = apply_layer_streaming(pipe.transformer, "cpu", StreamingConfig(hosting=groups))
    try:
        # Every forward of this call has one row (the pipelines run guidance as separate forwards).
        with loras.rows([("x", SCALE)]):
            got = _levels(call())
        plain = _levels(call())
    finally:
        streamer.remove()
        loras.close()
    moved, diff = np.abs(want - base).max(), np.abs(got - want).max()
    logger.info("%s: the adapter moves the image by up to %d levels; ours vs diffusers: %d", family.__name__, moved,
                diff)
    assert moved >= 8  # the adapter changes the image well beyond the tolerance
    assert diff <= 1
    assert np.array_equal(plain, base)  # outside rows(): the pipeline's own image
