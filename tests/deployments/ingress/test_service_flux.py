"""The same service serves a Flux folder: images equal the in-process FluxPipeline, video is refused."""
from __future__ import annotations

import base64
import os

import httpx
import pytest
import torch

from deployments.models import families
from deployments.wire import media
from deployments.wire.spec import GenerationSpec
from tests.deployments.conftest import TOKEN, TOKEN_ENV, serve_base_url, tiny_args
from zoo.tiny import ensure_tiny_flux

APP, PREFIX = "svc-flux", "/flux"


@pytest.fixture(scope="module")
def flux(ray_cluster):
    from ray import serve

    from deployments.app import build_app

    os.environ[TOKEN_ENV] = TOKEN
    base = serve_base_url(ray_cluster)
    serve.run(build_app(tiny_args(app_name=APP, tiny_family="flux")), name=APP, route_prefix=PREFIX)
    try:
        with httpx.Client(base_url=base + PREFIX, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=120) as c:
            yield c
    finally:
        serve.delete(APP)


def test_a_flux_image_over_http_equals_the_in_process_pipeline(flux):
    response = flux.post("/v1/images/generations", json={"prompt": "a red barn", "size": "32x16", "seed": 3,
                                                         "num_inference_steps": 2, "n": 2})
    assert response.status_code == 200, response.text
    facts = families.read_family_facts(ensure_tiny_flux())
    spec = GenerationSpec("r", "a red barn", None, 16, 32, 1, 2, facts.default_guidance, 3, 2)
    reference = families.reference_frames(families.load_full_pipeline(facts, torch.float32), facts, spec)
    assert [base64.b64decode(d["b64_json"]) for d in response.json()["data"]] == \
        [media.png_bytes(frames[0]) for frames in reference]
    (model,) = flux.get("/v1/models").json()["data"]
    assert (model["family"], model["modalities"]) == ("flux", ["image"])


def test_video_and_negative_prompts_are_refused_for_flux_naming_the_field(flux):
    video = flux.post("/v1/videos/generations", json={"prompt": "a red barn"})
    assert video.status_code == 400 and video.json()["error"]["param"] == "model"
    negative = flux.post("/v1/images/generations", json={"prompt": "a red barn", "negative_prompt": "fog"})
    assert negative.status_code == 400 and negative.json()["error"]["param"] == "negative_prompt"
