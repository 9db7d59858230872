"""A stage that fails at start-up in the real service: health, models, images and video jobs say so at once.

The module's one app: the tiny Wan whose transformer checkpoint is truncated, so the Denoiser's
replicas fail in their constructor (safetensors refuses the file) while the encoder, the decoder
and the ingress start; Serve marks the Denoiser DEPLOY_FAILED.
"""
from __future__ import annotations

import os
import shutil
import time

import httpx
import pytest

from tests.deployments.conftest import TOKEN, TOKEN_ENV, delete_app, serve_base_url, tiny_args
from tests.waiting import wait_for
from zoo.tiny import ensure_tiny_wan

APP, PREFIX = "svc-broken", "/broken"


@pytest.fixture(scope="module")
def broken(ray_cluster, tmp_path_factory):
    from ray import serve

    from deployments.app import build_app_with

    folder = tmp_path_factory.mktemp("broken") / "tiny-wan"
    shutil.copytree(ensure_tiny_wan(), folder)
    weights = folder / "transformer" / "diffusion_pytorch_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:64])  # a header cut short: the Denoiser cannot load it
    os.environ[TOKEN_ENV] = TOKEN
    base = serve_base_url(ray_cluster)
    # Serve gives up after one failed constructor, not three (its default for one replica): each try
    # is a fresh worker importing torch (~5 s here), and the second test waits for Serve to give up.
    app = build_app_with(tiny_args(app_name=APP, model_path=str(folder)), {"Denoiser": {"max_constructor_retry_count": 1}})
    # Not serve.run: it waits for the app to run, and raises when it failed to deploy.
    serve._run(app, name=APP, route_prefix=PREFIX, _blocking=False)
    try:
        with httpx.Client(base_url=base + PREFIX, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30) as client:
            yield client
    finally:
        delete_app(APP)


def _down_health(client: httpx.Client, failed: bool):
    """The ingress's 503 naming the Denoiser (with ``failed``: once Serve gave up on it); None until then
    (the proxy holds requests, or answers in plain text, while no ingress replica is up)."""
    try:
        response = client.get("/health")
    except httpx.TimeoutException:
        return None
    if not response.headers.get("content-type", "").startswith("application/json") or response.status_code != 503:
        return None
    return response if "stage Denoiser is not running" in response.text and (
        not failed or "failed to deploy" in response.text) else None


def test_health_models_images_and_video_jobs_refuse_while_a_stage_cannot_serve(broken):
    # While it starts (and fails) the Denoiser has no running replica: refused at once.
    health = wait_for(lambda: _down_health(broken, failed=False), 300, "the ingress to report the Denoiser down")
    error = health.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == "stage_not_running"
    assert health.headers["retry-after"] == "1"
    (card,) = broken.get("/v1/models").json()["data"]
    assert card["serving"] is False and "stage Denoiser is not running" in card["not_serving"]
    start = time.monotonic()
    image = broken.post("/v1/images/generations", json={"prompt": "a fox", "size": "16x16"})
    assert time.monotonic() - start < 5, "a request must be refused at once, not wait on the failed stage"
    assert image.status_code == 503 and image.headers["retry-after"] == "1", image.text
    assert image.json()["error"]["code"] == "stage_not_running"
    job = broken.post("/v1/videos", json={"prompt": "waves", "seconds": "1", "size": "16x16"})
    assert job.status_code == 503 and job.json()["error"]["code"] == "stage_not_running", job.text
    assert broken.get("/v1/videos").json()["data"] == [], "no job was queued for nothing to run"


def _failed_alone(client: httpx.Client):
    """The 503 once Serve gave up on the Denoiser and the other stages run (Serve gives up after one try,
    which can be before the encoder and decoder are up: health names them as deploying until then)."""
    response = _down_health(client, failed=True)
    return response if response and "TextEncoder" not in response.text and "VaeDecoder" not in response.text else None


def test_once_serve_gives_up_health_names_the_stage_and_serves_reason(broken):
    health = wait_for(lambda: _failed_alone(broken), 600, "the Denoiser to fail to deploy while the others run")
    message = health.json()["error"]["message"]
    assert "stage Denoiser is not running (failed to deploy: " in message
