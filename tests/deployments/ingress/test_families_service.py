"""Wan2.2 A14B image-to-video on real Ray Serve, through the official openai client: one app for the module.

The tiny Wan2.2 I2V-A14B: two experts in the Denoiser (``/v1/residency`` lists each one's weights
and bytes), a reference image in as a multipart file (``videos.create_and_poll``) and as a JSON data
URL, checked at the ingress (a non-image or a truncated image is a 400 naming ``input_reference``).
The text-to-video A14B and every other family are held to the same staged and batched results
in-process (tests/deployments/models/test_conformance.py).
"""
from __future__ import annotations

import base64
import io
import os

import httpx
import imageio.v3 as iio
import openai
import pytest
from PIL import Image

from deployments.capacity.request_limits import Limits
from tests.deployments.conftest import TOKEN, TOKEN_ENV, delete_app, serve_base_url, tiny_args
from tests.waiting import wait_for
from zoo.wan22 import ensure_tiny_wan22_i2v

APP, PREFIX = "families-test", "/families"
pytestmark = pytest.mark.filterwarnings("ignore:The Sora API:DeprecationWarning")
LIMITS = Limits(max_width=32, max_height=32, max_steps=8, max_n=1, max_prompt_chars=200, max_frames=9,
                default_size="16x16", default_steps=4, default_frames=5, default_fps=4)
# 4 steps at flow_shift 3.0: timesteps 999, 900 on the high-noise expert, 750, 500 on the low-noise one.
EXTRA = {"fps": 4, "seed": 3, "num_inference_steps": 4}


def _png(colour=(200, 40, 30)) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (16, 16), colour).save(out, format="PNG")
    return out.getvalue()


@pytest.fixture(scope="module")
def app(ray_cluster, tmp_path_factory):
    from ray import serve

    from deployments.app import build_app
    from deployments.jobs.queue import JobsArgs

    jobs = JobsArgs(directory=str(tmp_path_factory.mktemp("jobs")), poll_after_ms=100)
    args = tiny_args(app_name=APP, limits=LIMITS, model_path=str(ensure_tiny_wan22_i2v()), video_jobs=jobs)
    os.environ[TOKEN_ENV] = TOKEN
    base = serve_base_url(ray_cluster) + PREFIX
    serve.run(build_app(args), name=APP, route_prefix=PREFIX)
    try:
        with openai.OpenAI(api_key=TOKEN, base_url=base + "/v1", timeout=120, max_retries=5) as client, \
                httpx.Client(base_url=base, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=120) as http:
            yield client, http
    finally:
        delete_app(APP)


def _frames(mp4: bytes):
    return iio.imread(mp4, extension=".mp4", plugin="FFMPEG")


def _data_url(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode()


def test_the_openai_client_makes_a_video_from_a_reference_file_and_a_data_url_makes_the_same(app):
    client, http = app
    (model,) = http.get("/v1/models").json()["data"]
    assert (model["family"], model["modalities"]) == ("wan-i2v", ["image-to-video", "video-extend"])
    video = client.videos.create_and_poll(prompt="a red cat", seconds="1", size="16x16", poll_interval_ms=100,
                                          input_reference=("ref.png", _png(), "image/png"), extra_body=EXTRA)
    assert video.status == "completed", video.error
    mp4 = client.videos.download_content(video.id).content
    assert _frames(mp4).shape == (5, 16, 16, 3), "1 s at 4 fps is 5 frames"
    body = {"prompt": "a red cat", "size": "16x16", "num_frames": 5, "response_format": "mp4", **EXTRA}
    sync = http.post("/v1/videos/generations", json={**body, "input_reference": _data_url(_png())})
    assert sync.status_code == 200 and sync.content == mp4, "a data URL and a file make the same video"
    other = http.post("/v1/videos/generations", json={**body, "input_reference": _data_url(_png((20, 200, 60)))})
    assert other.status_code == 200 and other.content != mp4, "the reference image conditions the video"


def test_a_bad_or_missing_reference_image_is_a_400_naming_input_reference(app):
    client, http = app
    for bad in (b"not an image at all", _png()[:40]):
        with pytest.raises(openai.BadRequestError) as refused:
            client.videos.create(prompt="a red cat", input_reference=("ref.png", bad, "image/png"))
        assert refused.value.body["param"] == "input_reference"
    with pytest.raises(openai.BadRequestError) as refused:
        client.videos.create(prompt="a red cat")
    assert refused.value.body["param"] == "input_reference" and "required" in refused.value.body["message"]
    refused = http.post("/v1/images/generations", json={"prompt": "a red cat"})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "model"


def test_residency_lists_both_experts_each_streamed_one_at_a_time(app):
    _, http = app

    def reported():
        replicas = http.get("/v1/residency").json()["replicas"]
        denoiser = next((r for r in replicas if r["stage"] == "denoise"), None)
        return denoiser if denoiser and denoiser["last_device_peak_bytes"] else None

    denoiser = wait_for(reported, timeout_s=60, what="the denoiser's residency report")
    experts = {c["name"]: c for c in denoiser["weights"]["components"]}
    assert set(experts) == {"transformer", "transformer_2"}
    for expert in experts.values():  # memory mode: each expert's 4 blocks streamed, on the host between calls
        assert sum(expert["layer_tiers"].values()) == 4, expert
    assert any(line.startswith("transformer_2: ") for line in denoiser["plan"]), denoiser["plan"]
    # One expert's working set at a time: the plan peaks in one expert's phase, and the replica measured it.
    assert "in stage denoise:transformer" in denoiser["plan"][0], denoiser["plan"][0]
    assert denoiser["last_device_peak_bytes"] == denoiser["predicted_peak_bytes"]


def test_an_extension_through_serve_is_the_source_then_the_pipelines_video_from_its_last_frame(app):
    import numpy as np
    import torch

    from deployments.models import families
    from deployments.wire import media
    from deployments.wire.spec import GenerationSpec

    client, _ = app
    unguided = {**EXTRA, "guidance_scale": 1.0}  # the staged result is then the pipeline's bit for bit
    video = client.videos.create_and_poll(prompt="a red cat", seconds="1", size="16x16", poll_interval_ms=100,
                                          input_reference=("ref.png", _png(), "image/png"), extra_body=unguided)
    source = client.videos.download_content(video.id).content
    extended = client.videos.extend(prompt="a red cat sleeps", seconds="1", video=("cat.mp4", source, "video/mp4"),
                                    extra_body={"seed": 4, "num_inference_steps": 4, "guidance_scale": 1.0})
    extended = client.videos.poll(extended.id, poll_interval_ms=100)
    assert (extended.status, extended.seconds, extended.size) == ("completed", "2", "16x16"), extended
    frames = media.video_frames(source, 5, (16, 16))
    facts = families.read_family_traits(ensure_tiny_wan22_i2v())
    spec = GenerationSpec("r", "a red cat sleeps", None, 16, 16, 5, 4, 1.0, 4, 1, media.png_bytes(frames[-1]))
    made = families.reference_frames(families.load_full_pipeline(facts, torch.float32), facts, spec)[0]
    expected = media.mp4_bytes(np.concatenate([frames, media.to_uint8(made[1:])]), 4)
    assert client.videos.download_content(extended.id).content == expected, "5 + 4 frames: 2 s at 4 fps"
