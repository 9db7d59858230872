"""OpenAI's image ``quality`` as denoising steps (deployments/capacity/request_limits.py: Limits.steps_for)."""
from __future__ import annotations

import pytest

from deployments.api.images.protocol import ImageRequest, image_spec
from deployments.capacity.request_limits import Limits, Quality
from deployments.models.families import read_family_traits
from zoo.tiny import ensure_tiny_wan

LIMITS = Limits(default_steps=20, max_steps=28, default_size="16x16")


@pytest.mark.parametrize("quality, steps", [
    ("auto", 20), ("standard", 20), ("low", 10), ("medium", 15), ("high", 20), ("hd", 20),
])
def test_each_quality_is_its_share_of_the_default_steps(quality, steps):
    assert LIMITS.steps_for(Quality(quality)) == steps


def test_a_share_rounds_up_never_below_the_models_fewest_steps_nor_above_the_most():
    assert Limits(default_steps=3).steps_for(Quality.LOW) == 2, "1.5 steps round up to 2"
    assert Limits(default_steps=2).steps_for(Quality.LOW, fewest=2) == 2, "Qwen-Image needs 2 (shift_terminal)"
    assert LIMITS.model_copy(update={"quality_high": 2.0}).steps_for(Quality.HD) == 28, "40 capped at max_steps"


def test_a_request_naming_its_steps_runs_them_whatever_its_quality():
    facts = read_family_traits(ensure_tiny_wan())
    low = image_spec(ImageRequest(prompt="a fox", quality="low"), facts, LIMITS, "m")
    named = image_spec(ImageRequest(prompt="a fox", quality="low", num_inference_steps=7), facts, LIMITS, "m")
    assert (low.steps, named.steps) == (10, 7)
