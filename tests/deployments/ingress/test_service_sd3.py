"""The service serves a Stable Diffusion 3.5 folder through the official openai client: images equal the
in-process StableDiffusion3Pipeline bitwise (guidance with a negative prompt included), edits the in-process
StableDiffusion3Img2ImgPipeline (the image encoded by the decoder replica, noised and denoised by the
Denoiser's), masked edits StableDiffusion3InpaintPipeline's latents, videos are refused.

One deployed app for the module (real Ray Serve is the point: the family's adapter in every stage replica).
It is the image-only family on real Serve; Flux and the others are held to the same staged results
in-process (tests/deployments/models/test_conformance.py) and to their refusals (api/test_schemas.py):
an app of their own cost the suite ~19 s and ~40 CPU-s each for the same Serve path.
"""
from __future__ import annotations

import base64
import io
import os

import openai
import pytest
import torch
from PIL import Image

from deployments.models import families
from deployments.wire import media
from deployments.wire.spec import GenerationSpec
from tests.deployments.conftest import TOKEN, TOKEN_ENV, serve_base_url, tiny_args
from zoo.tiny_families import ensure_tiny_sd3

APP, PREFIX = "svc-sd3", "/sd3"


@pytest.fixture(scope="module")
def client(ray_cluster):
    from ray import serve

    from deployments.app import build_app

    os.environ[TOKEN_ENV] = TOKEN
    base = serve_base_url(ray_cluster)
    serve.run(build_app(tiny_args(app_name=APP, model_path=str(ensure_tiny_sd3()), model_id="sd3")), name=APP,
              route_prefix=PREFIX)
    try:
        with openai.OpenAI(api_key=TOKEN, base_url=base + PREFIX + "/v1", timeout=120, max_retries=5) as c:
            yield c
    finally:
        serve.delete(APP)


def _reference(spec: GenerationSpec) -> list[bytes]:
    facts = families.read_family_traits(ensure_tiny_sd3())
    frames = families.reference_frames(families.load_full_pipeline(facts, torch.float32), facts, spec)
    return [media.png_bytes(video[0]) for video in frames]


def test_images_generate_through_the_openai_client_equal_the_in_process_pipeline(client):
    result = client.images.generate(model="sd3", prompt="a red barn", size="32x16", n=2, response_format="b64_json",
                                    extra_body={"seed": 3, "num_inference_steps": 2, "negative_prompt": "fog",
                                                "guidance_scale": 5.0})
    assert [base64.b64decode(d.b64_json) for d in result.data] == \
        _reference(GenerationSpec("r", "a red barn", "fog", 16, 32, 1, 2, 5.0, 3, 2))
    (model,) = client.models.list().data
    assert (model.id, model.model_extra["family"], model.model_extra["modalities"]) == ("sd3", "sd3",
                                                                                                 ["image", "image-edit", "image-inpaint"])


def test_the_default_guidance_is_the_pipelines_and_guidance_1_runs_one_branch(client):
    defaults = client.images.generate(model="sd3", prompt="a boat", size="16x16", extra_body={"seed": 5})
    assert [base64.b64decode(d.b64_json) for d in defaults.data] == \
        _reference(GenerationSpec("r", "a boat", None, 16, 16, 1, 2, 7.0, 5, 1))
    unguided = client.images.generate(model="sd3", prompt="a boat", size="16x16",
                                      extra_body={"seed": 5, "guidance_scale": 1.0})
    assert base64.b64decode(unguided.data[0].b64_json) != base64.b64decode(defaults.data[0].b64_json)
    assert [base64.b64decode(d.b64_json) for d in unguided.data] == \
        _reference(GenerationSpec("r", "a boat", None, 16, 16, 1, 2, 1.0, 5, 1))


def test_a_video_or_a_size_off_the_multiple_is_the_openai_error_naming_the_field(client):
    with pytest.raises(openai.BadRequestError) as refused:
        client.videos.create(model="sd3", prompt="a red barn")
    assert refused.value.body["param"] == "model"
    with pytest.raises(openai.BadRequestError) as refused:
        client.images.generate(model="sd3", prompt="a red barn", size="18x16")
    assert refused.value.body["param"] == "size"


def test_an_edit_through_the_openai_client_equals_the_in_process_img2img_pipeline(client):
    photo = io.BytesIO()
    Image.new("RGB", (32, 16), (200, 120, 40)).save(photo, format="PNG")
    events = list(client.images.edit(model="sd3", image=("barn.png", photo.getvalue(), "image/png"), prompt="a red barn",
                                     n=2, stream=True, partial_images=1,
                                     extra_body={"seed": 3, "num_inference_steps": 4, "strength": 0.5,
                                                 "negative_prompt": "fog", "guidance_scale": 5.0}))
    assert [e.step for e in events if e.type == "progress"] == [1, 2]  # 0.5 of 4 steps
    assert [e.step for e in events if e.type == "image_edit.partial_image"] == [1, 1]
    completed = [base64.b64decode(e.b64_json) for e in events if e.type == "image_edit.completed"]
    spec = GenerationSpec("r", "a red barn", "fog", 16, 32, 1, 4, 5.0, 3, 2, photo.getvalue(), strength=0.5)
    assert completed == _reference(spec)


def test_a_masked_edit_through_the_openai_client_equals_the_in_process_inpaint_pipeline(client):
    photo, mask = io.BytesIO(), io.BytesIO()
    image = Image.new("RGB", (32, 16), (200, 120, 40))
    image.paste((20, 60, 220), (0, 0, 12, 16))
    image.save(photo, format="PNG")
    alpha = Image.new("RGBA", (32, 16), (0, 0, 0, 255))
    alpha.paste((0, 0, 0, 0), (16, 0, 32, 16))  # the right half may be repainted
    alpha.save(mask, format="PNG")
    extras = {"seed": 3, "num_inference_steps": 4, "strength": 1.0}
    result = client.images.edit(model="sd3", image=("barn.png", photo.getvalue(), "image/png"), prompt="a red barn",
                                mask=("mask.png", mask.getvalue(), "image/png"), extra_body=extras)
    spec = GenerationSpec("r", "a red barn", None, 16, 32, 1, 4, 7.0, 3, 1, photo.getvalue(), strength=1.0,
                          mask_image=mask.getvalue())
    assert [base64.b64decode(d.b64_json) for d in result.data] == _reference(spec)
    plain = client.images.edit(model="sd3", image=("barn.png", photo.getvalue(), "image/png"), prompt="a red barn",
                               extra_body=extras)
    assert plain.data[0].b64_json != result.data[0].b64_json
