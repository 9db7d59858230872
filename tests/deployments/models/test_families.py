"""The stage split reproduces the in-process diffusers pipeline bitwise, for both families."""
from __future__ import annotations

import pytest
import torch

from deployments.models import families
from deployments.wire.spec import Family, GenerationSpec, PipelineStage

ENCODE, DENOISE, DECODE = PipelineStage.ENCODE, PipelineStage.DENOISE, PipelineStage.DECODE
from zoo.tiny import ensure_tiny_flux, ensure_tiny_wan

F32 = torch.float32


def _staged(facts, spec):
    device = torch.device("cpu")
    steps = []
    encoded = families.encode(families.load_stage_pipeline(facts, ENCODE, F32), facts, spec, device)
    latents = families.denoise(families.load_stage_pipeline(facts, DENOISE, F32), facts, encoded, spec, device,
                               on_step=steps.append)
    frames = families.decode(families.load_stage_pipeline(facts, DECODE, F32), facts, latents, spec)
    return frames, steps


def test_staged_wan_video_with_guidance_equals_the_in_process_pipeline_bitwise():
    facts = families.read_family_traits(ensure_tiny_wan())
    spec = GenerationSpec("r", "a red fox in snow", "blurry", 32, 16, 5, 3, 5.0, 11, 2)
    frames, steps = _staged(facts, spec)
    reference = families.reference_frames(families.load_full_pipeline(facts, F32), facts, spec)
    assert frames.shape == (2, 5, 32, 16, 3)
    assert torch.equal(frames, reference), "staged Wan output drifted from pipe(prompt, generator=seed)"
    assert [(s.step, s.total) for s in steps] == [(1, 3), (2, 3), (3, 3)]


def test_staged_flux_image_equals_the_in_process_pipeline_bitwise():
    facts = families.read_family_traits(ensure_tiny_flux())
    spec = GenerationSpec("r", "a lighthouse", None, 16, 32, 1, 2, 3.5, 5, 1)
    frames, _ = _staged(facts, spec)
    reference = families.reference_frames(families.load_full_pipeline(facts, F32), facts, spec)
    assert frames.shape == (1, 1, 16, 32, 3)
    assert torch.equal(frames, reference), "staged Flux output drifted from pipe(prompt, generator=seed)"


def test_a_different_seed_changes_the_output():
    facts = families.read_family_traits(ensure_tiny_wan())
    one = GenerationSpec("r", "a cat", None, 16, 16, 1, 2, 5.0, 1, 1)
    two = GenerationSpec("r", "a cat", None, 16, 16, 1, 2, 5.0, 2, 1)
    assert not torch.equal(_staged(facts, one)[0], _staged(facts, two)[0])


def test_each_stage_loads_only_its_own_components():
    facts = families.read_family_traits(ensure_tiny_wan())
    encoder = families.load_stage_pipeline(facts, ENCODE, F32)
    assert encoder.text_encoder is not None and encoder.transformer is None and encoder.vae is None
    denoiser = families.load_stage_pipeline(facts, DENOISE, F32)
    assert denoiser.transformer is not None and denoiser.text_encoder is None and denoiser.vae is None
    decoder = families.load_stage_pipeline(facts, DECODE, F32)
    assert decoder.vae is not None and decoder.text_encoder is None and decoder.transformer is None


def test_family_facts_read_size_rules_from_the_folder_configs():
    wan = families.read_family_traits(ensure_tiny_wan())
    assert (wan.family, wan.size_multiple, wan.temporal_factor, wan.supports_video) == (Family.WAN, 16, 4, True)
    flux = families.read_family_traits(ensure_tiny_flux())
    assert flux.family is Family.FLUX and not flux.supports_video
    # The pipeline's own rule: FluxPipeline packs 2x2 latent patches, so sizes step by twice its
    # VAE scale factor (2 ** (len(block_out_channels) - 1), read by diffusers from the same folder).
    decoder = families.load_stage_pipeline(flux, DECODE, F32)
    assert flux.size_multiple == decoder.vae_scale_factor * 2


def test_a_folder_of_another_pipeline_is_refused_by_name(tmp_path):
    (tmp_path / "model_index.json").write_text('{"_class_name": "StableDiffusionPipeline"}')
    with pytest.raises(families.UnsupportedModelFolder, match="StableDiffusionPipeline"):
        families.read_family_traits(tmp_path)
