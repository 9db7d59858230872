"""Every invalid field is refused with its name; valid requests become a full GenerationSpec."""
from __future__ import annotations

import pytest
from pydantic import ValidationError

from deployments.api.images.protocol import ImageRequest, image_spec
from deployments.api.videos.protocol import VideoRequest, video_spec
from deployments.capacity.request_limits import FieldError, Limits
from deployments.models.families import read_family_traits
from zoo.tiny import ensure_tiny_flux, ensure_tiny_wan

LIMITS = Limits(max_width=64, max_height=64, max_steps=4, max_n=2, max_prompt_chars=20, max_frames=9,
                default_size="16x16", default_steps=2, default_frames=5)


@pytest.fixture(scope="module")
def wan():
    return read_family_traits(ensure_tiny_wan())


@pytest.mark.parametrize("body, param, status", [
    ({"prompt": "a cat", "size": "24x16"}, "size", 400),  # not a multiple of 16
    ({"prompt": "a cat", "size": "128x16"}, "size", 400),  # over max_width
    ({"prompt": "a cat", "size": "16by16"}, "size", 400),
    ({"prompt": "a cat", "num_inference_steps": 5}, "num_inference_steps", 400),
    ({"prompt": "a cat", "n": 3}, "n", 400),
    ({"prompt": "   "}, "prompt", 400),
    ({"prompt": "x" * 21}, "prompt", 400),
    ({"prompt": "a cat", "negative_prompt": "y" * 21}, "negative_prompt", 400),
    ({"prompt": "a cat", "model": "sdxl"}, "model", 404),
    ({"prompt": "a cat", "response_format": "url"}, "response_format", 400),
    ({"prompt": "a cat", "output_compression": 50}, "output_compression", 400),  # png is lossless
    ({"prompt": "a cat", "partial_images": 2}, "partial_images", 400),  # previews are events: stream only
])
def test_an_invalid_image_field_is_refused_naming_it(wan, body, param, status):
    with pytest.raises(FieldError) as caught:
        image_spec(ImageRequest.model_validate(body), wan, LIMITS, "tiny-wan")
    assert (caught.value.param, caught.value.status) == (param, status)


@pytest.mark.parametrize("body, field", [
    ({"prompt": "a cat", "n": 0}, "n"),
    ({"prompt": "a cat", "num_inference_steps": 0}, "num_inference_steps"),
    ({"prompt": "a cat", "seed": -1}, "seed"),
    ({"prompt": "a cat", "guidance_scale": "high"}, "guidance_scale"),
    ({"size": "16x16"}, "prompt"),
    ({"prompt": "a cat", "num_inference_step": 2}, "num_inference_step"),  # a typo is an unknown field
    ({"prompt": "a cat", "output_format": "gif"}, "output_format"),
    ({"prompt": "a cat", "output_format": "jpeg", "output_compression": 101}, "output_compression"),
    ({"prompt": "a cat", "partial_images": 4}, "partial_images"),  # OpenAI's range is 0-3
])
def test_a_mistyped_or_unknown_field_fails_validation_naming_it(body, field):
    with pytest.raises(ValidationError) as caught:
        ImageRequest.model_validate(body)
    assert caught.value.errors()[0]["loc"][0] == field


@pytest.mark.parametrize("body, param", [
    ({"prompt": "a cat", "num_frames": 4}, "num_frames"),  # not 1 + 4k
    ({"prompt": "a cat", "num_frames": 13}, "num_frames"),  # over max_frames
    ({"prompt": "a cat", "response_format": "gif"}, "response_format"),
    ({"prompt": "a cat", "response_format": "mp4", "stream": True}, "stream"),  # events carry JSON
])
def test_an_invalid_video_field_is_refused_naming_it(wan, body, param):
    with pytest.raises(FieldError) as caught:
        video_spec(VideoRequest.model_validate(body), wan, LIMITS, "tiny-wan")
    assert caught.value.param == param


def test_video_and_negative_prompt_are_refused_for_an_image_only_family():
    flux = read_family_traits(ensure_tiny_flux())
    with pytest.raises(FieldError) as caught:
        video_spec(VideoRequest(prompt="a cat"), flux, LIMITS, "tiny-flux")
    assert caught.value.param == "model"
    with pytest.raises(FieldError) as caught:
        image_spec(ImageRequest(prompt="a cat", negative_prompt="dull"), flux, LIMITS, "tiny-flux")
    assert caught.value.param == "negative_prompt"


def test_a_valid_request_gets_the_configured_defaults_and_a_seed(wan):
    spec = image_spec(ImageRequest(prompt="a cat", size="32x16", n=2), wan, LIMITS, "tiny-wan")
    assert (spec.width, spec.height, spec.n, spec.num_frames, spec.steps) == (32, 16, 2, 1, LIMITS.default_steps)
    assert spec.guidance_scale == wan.default_guidance and spec.seed >= 0
    video = video_spec(VideoRequest(prompt="a cat", seed=7), wan, LIMITS, "tiny-wan")
    assert (video.num_frames, video.seed, video.n) == (LIMITS.default_frames, 7, 1)


def test_size_auto_is_the_configured_default_size(wan):
    """OpenAI's gpt-image models default to size "auto" (the model picks): here the configured default."""
    for request in (ImageRequest(prompt="a cat", size="auto"), VideoRequest(prompt="a cat", size="auto")):
        spec = (image_spec if isinstance(request, ImageRequest) else video_spec)(request, wan, LIMITS, "tiny-wan")
        assert f"{spec.width}x{spec.height}" == LIMITS.default_size


def test_a_request_sets_its_step_cache_threshold_or_leaves_it_to_the_deployment(wan):
    assert image_spec(ImageRequest(prompt="a cat"), wan, LIMITS, "m").cache_threshold is None
    assert image_spec(ImageRequest(prompt="a cat", cache_threshold=0.1), wan, LIMITS, "m").cache_threshold == 0.1
    assert image_spec(ImageRequest(prompt="a cat", cache_threshold=0), wan, LIMITS, "m").cache_threshold == 0
    for bad in (-0.1, 1.5, "high"):
        with pytest.raises(ValidationError, match="cache_threshold"):
            ImageRequest(prompt="a cat", cache_threshold=bad)
