"""Qwen-Image-Edit (deployments/models/qwen_image_edit.py) beyond the conformance suite's square request: the
sizes the pipelines fit the image to, an edit of another aspect at another output size through the step
batcher, the first pipeline's folder and -2511's transformer (``zero_cond_t``), what the Denoiser refuses,
and the activation model's count of the image's tokens.

In-process on the tiny zoo's QwenImageEditPlusPipeline folder, and two folders built here from the same recipe.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from deployments.models import activation_features as activations
from deployments.models import families
from deployments.models.qwen_image_edit import CONDITION_AREA, VAE_AREA, area_size, vae_size
from deployments.models.registry import adapter_for
from deployments.wire.spec import EditRule, GenerationSpec, PipelineStage
from tests.deployments.models.in_context import a_photo, through_a_step_batch
from zoo.tiny_families import build_qwen_image_edit, ensure_tiny_qwen_image_edit

CPU, F32 = torch.device("cpu"), torch.float32
ENCODE, DENOISE, DECODE = PipelineStage.ENCODE, PipelineStage.DENOISE, PipelineStage.DECODE


def _loaded(folder):
    facts = families.read_family_traits(folder)
    return facts, {s: families.load_stage_pipeline(facts, s, F32) for s in PipelineStage}


@pytest.fixture(scope="module")
def plus():
    return _loaded(ensure_tiny_qwen_image_edit())


def _encoded(facts, pipes, spec):
    encoded = families.encode(pipes[ENCODE], facts, spec, CPU)
    return dataclasses.replace(encoded, image_condition=families.condition(pipes[DECODE], facts, spec, CPU))


def _staged(facts, pipes, spec) -> torch.Tensor:
    latents = families.denoise(pipes[DENOISE], facts, _encoded(facts, pipes, spec), spec, CPU)
    return families.decode(pipes[DECODE], facts, latents, spec, CPU)


def _reference(facts, spec) -> torch.Tensor:
    return families.reference_frames(families.load_full_pipeline(facts, F32), facts, spec)


def test_the_areas_and_the_fit_are_the_pipelines():
    from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit_plus as plus_module

    assert (CONDITION_AREA, VAE_AREA) == (plus_module.CONDITION_IMAGE_SIZE, plus_module.VAE_IMAGE_SIZE)
    for width, height in ((512, 512), (1200, 800), (4000, 500), (60, 90)):
        for area in (CONDITION_AREA, VAE_AREA):
            fitted_width, fitted_height = plus_module.calculate_dimensions(area, width / height)
            assert area_size(area, width, height) == (fitted_height, fitted_width)
    # From the header, upright (EXIF 6: stored landscape, shown portrait): 2:3 at a megapixel.
    assert vae_size(a_photo(90, 60, orientation=6)) == area_size(VAE_AREA, 60, 90) == (1248, 832)


def test_an_edit_of_another_aspect_through_the_step_batcher_is_bitwise_the_pipeline(plus):
    facts, pipes = plus
    assert facts.edit_rule is EditRule.IN_CONTEXT and facts.modalities == ("image-edit",)
    spec = GenerationSpec("e", "a red fox", None, 16, 32, 1, 2, 4.0, 4, 2, a_photo(60, 40))
    stepper = adapter_for(facts).stepper(pipes[DENOISE], facts, CPU)
    latents = through_a_step_batch(stepper, stepper.start(_encoded(facts, pipes, spec), spec))
    frames = families.decode(pipes[DECODE], facts, latents, spec, CPU)
    assert frames.shape == (2, 1, 16, 32, 3) and torch.equal(frames, _reference(facts, spec))
    other = dataclasses.replace(spec, reference_image=a_photo(40, 60))  # another image: another edit
    assert not torch.equal(_staged(facts, pipes, other), frames)


def test_two_images_composed_in_context_through_the_step_batcher_are_bitwise_the_pipeline_given_both(plus):
    facts, pipes = plus
    assert facts.max_images == 3
    first, second = a_photo(60, 40), a_photo(32, 48)  # 3:2 and 2:3: 1248x832 and 832x1248, 4056 tokens each
    spec = GenerationSpec("m", "the fox from picture 1 in picture 2", None, 16, 32, 1, 2, 4.0, 4, 1, first,
                          context_images=(second,))
    assert adapter_for(facts).context_tokens(facts, spec) == 2 * 78 * 52
    stepper = adapter_for(facts).stepper(pipes[DENOISE], facts, CPU)
    latents = through_a_step_batch(stepper, stepper.start(_encoded(facts, pipes, spec), spec))
    frames = families.decode(pipes[DECODE], facts, latents, spec, CPU)
    assert torch.equal(frames, _reference(facts, spec))
    swapped = dataclasses.replace(spec, reference_image=second, context_images=(first,))  # Picture 1 is the other
    assert not torch.equal(_staged(facts, pipes, swapped), frames)
    assert not torch.equal(_staged(facts, pipes, dataclasses.replace(spec, context_images=())), frames)


def test_guided_edits_staged_are_bitwise_the_pipeline_and_the_negative_prompt_sees_the_image(plus):
    facts, pipes = plus
    spec = GenerationSpec("g", "a red fox", " ", 32, 16, 1, 2, 4.0, 5, 1, a_photo(40, 60))
    encoded = families.encode(pipes[ENCODE], facts, spec, CPU)
    text_only = pipes[ENCODE].encode_prompt(prompt=" ", image=None, device=CPU)[0]
    assert encoded.negative_prompt_embeds.shape[1] > text_only.shape[1]  # the image's tokens are in it
    assert torch.equal(_staged(facts, pipes, spec), _reference(facts, spec))


@pytest.mark.parametrize("variant", ["first", "2511"])
def test_the_first_pipelines_folder_and_2511s_transformer_are_bitwise_their_pipelines(tmp_path, variant):
    build_qwen_image_edit(tmp_path, plus=variant != "first", zero_cond_t=variant == "2511")
    facts, pipes = _loaded(tmp_path)
    assert facts.pipeline_class == ("QwenImageEditPipeline" if variant == "first" else "QwenImageEditPlusPipeline")
    assert facts.max_images == (1 if variant == "first" else 3)  # the first pipeline's template shows one
    spec = GenerationSpec("v", "a red fox", None, 16, 32, 1, 2, 4.0, 6, 1, a_photo(48, 40))
    assert torch.equal(_staged(facts, pipes, spec), _reference(facts, spec))
    # 2511 modulates the image's tokens with timestep 0 itself (a per-token index): no row-sliced step cache.
    assert adapter_for(facts).stepper(pipes[DENOISE], facts, CPU).cacheable is (variant == "first")


def test_the_denoiser_refuses_an_edit_without_the_image_by_name(plus):
    facts, pipes = plus
    spec = GenerationSpec("r", "a red fox", None, 16, 16, 1, 2, 4.0, 1, 1, a_photo(16, 16))
    encoded = families.encode(pipes[ENCODE], facts, spec, CPU)
    with pytest.raises(ValueError, match="image_condition"):
        adapter_for(facts).stepper(pipes[DENOISE], facts, CPU).start(encoded, spec)


def test_the_image_counts_as_4096_denoiser_tokens_and_the_decoder_leases_its_encode_at_a_megapixel(plus):
    facts, _ = plus
    square = GenerationSpec("s", "a red fox", None, 16, 16, 1, 2, 4.0, 1, 2, a_photo(20, 20))
    wide = dataclasses.replace(square, reference_image=a_photo(60, 40))  # 3:2: 1248x832, 78 x 52 tokens
    adapter = adapter_for(facts)
    assert adapter.context_tokens(facts, square) == 4096 and adapter.context_tokens(facts, wide) == 78 * 52
    # 1 latent token, the image's 4096, and the prompt's: the stand-in's 64 before the encoder has counted them.
    assert activations.features(facts, DENOISE, square) == (2.0, 2.0 * (1 + 4096 + 64))
    assert activations.features(facts, DENOISE, dataclasses.replace(square, text_tokens=300)) == (2.0, 2.0 * (1 + 4096 + 300))
    shape = families.condition_shape(facts, wide)
    assert (shape.height, shape.width) == (832, 1248)
