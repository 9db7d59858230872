"""Wan2.1 image-to-video's CLIP image encoder runs in the encoder stage, warm-up included (whose shapes
carry no reference image: a grey stand-in of the shape's size takes its place)."""
from __future__ import annotations

import torch

from deployments.models import activation_features as activations
from deployments.models import families
from deployments.wire.spec import PipelineStage
from zoo.wan22 import CLIP_IMAGE_SIDE, CLIP_PATCH, CLIP_WIDTH, ensure_tiny_wan21_i2v

CPU, ENCODE = torch.device("cpu"), PipelineStage.ENCODE


def test_the_encoder_stage_calibrates_and_warms_up_without_a_reference_image():
    facts = families.read_family_traits(ensure_tiny_wan21_i2v())
    assert families.stage_component_names(facts, ENCODE) == ("text_encoder", "image_encoder")
    pipe = families.load_stage_pipeline(facts, ENCODE, torch.float32)
    for spec in activations.calibration_shapes(facts, stage=ENCODE):  # as the replica's warm-up makes them
        assert spec.reference_image is None
        value = activations.stage_input(pipe, facts, ENCODE, spec)
        encoded = activations.run_stage(pipe, facts, ENCODE, spec, CPU, value)
        tokens = (CLIP_IMAGE_SIDE // CLIP_PATCH) ** 2 + 1
        assert encoded.image_embeds.shape == (spec.n, tokens, CLIP_WIDTH)
        assert encoded.prompt_embeds.shape[0] == spec.n
