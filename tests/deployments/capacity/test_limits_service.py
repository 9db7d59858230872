"""The tiny Wan app on a fake GPU node whose share binds: limits stated, enforced, and a pending replica.

The VaeDecoder asks 0.0004 of an RTX 3060 (4.4 MB of its 11 GB pool), so its activation room binds
below the configured limits on every number; two Denoisers at 0.6 GPU cannot both be placed on the
node's one GPU beside it, so one waits, and /v1/residency says why. build_app warned before deploying.
"""
from __future__ import annotations

import logging
import os

import httpx
import pytest
import ray
from ray import serve

from deployments.capacity.request_limits import Limits
from tests.conftest import QUIET_NODE
from tests.deployments.conftest import TOKEN, TOKEN_ENV, delete_app, serve_base_url, tiny_args
from tests.waiting import wait_for

APP, PREFIX = "limits-test", "/limits"
DECODER_GPUS = 0.0004  # 4.4 MB of the fake RTX 3060's 11.04 GB pool: ~4 MB of activations beside the decoder
DENOISER_GPUS = 0.6  # two of them do not fit one GPU: the second waits
LIMITS = Limits(max_width=256, max_height=256, max_steps=4, max_n=16, max_prompt_chars=200, max_frames=81,
                default_size="32x32", default_steps=1, default_frames=5, default_fps=4)
MiB = 2**20


class Captured(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


@pytest.fixture(scope="module")
def gpu_app(ray_cluster):
    """(http client, the build-time warnings) of the app on a one-GPU fake node; removed afterwards."""
    from deployments.app import build_app_with

    node = ray_cluster.add_node(**QUIET_NODE, num_cpus=1, num_gpus=1, object_store_memory=100 * MiB,
                                resources={"accelerator_type:RTX3060": 1, "offload_fake_ram_gb": 8})
    ray_cluster.wait_for_nodes()
    os.environ[TOKEN_ENV] = TOKEN
    base = serve_base_url(ray_cluster)
    captured = Captured()
    logging.getLogger("deployments.capacity.unplaced").addHandler(captured)
    # The Denoisers get 1 s to stop, not the app's 120 s: at the teardown the waiting one is placed as
    # soon as the other frees the GPU, and its deletion waited out its start (~2-3 s of the teardown).
    options = {"VaeDecoder": {"ray_actor_options": {"num_cpus": 0, "num_gpus": DECODER_GPUS}},
               "Denoiser": {"num_replicas": 2, "ray_actor_options": {"num_cpus": 0, "num_gpus": DENOISER_GPUS},
                            "graceful_shutdown_timeout_s": 1.0}}
    try:
        app = build_app_with(tiny_args(app_name=APP, limits=LIMITS, cluster_autoscaler=False), options)
    finally:
        logging.getLogger("deployments.capacity.unplaced").removeHandler(captured)
    serve._run(app, _blocking=False, name=APP, route_prefix=PREFIX)  # one Denoiser never starts: no wait
    try:
        with httpx.Client(base_url=base + PREFIX, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=120) as client:
            yield client, captured.messages
    finally:
        delete_app(APP)
        ledger = f"offload-ledger-{node.node_id}"
        if ledger in {a["name"] for a in ray.util.list_named_actors(all_namespaces=True)}:
            ray.kill(ray.get_actor(ledger, namespace="offload-serve"), no_restart=True)
        ray_cluster.remove_node(node)


def _measured_limits(client) -> dict:
    def measured():
        try:
            (model,) = client.get("/v1/models").json()["data"]
        except (httpx.HTTPError, ValueError, KeyError):  # the ingress is still starting
            return None
        # Serving too: a stage replica reports (in its constructor) before it is RUNNING, and a POST
        # before that is a 503 (not serving); the board no longer takes seconds to import torch first.
        serving = model["limits"]["source"] == "measured" and model["serving"]
        return model["limits"] if serving else None

    return wait_for(measured, 300, "every stage replica's report (limits measured) and every stage running")


def test_build_app_warned_that_the_second_denoiser_can_never_be_placed(gpu_app):
    _, warnings = gpu_app
    (warning,) = warnings
    assert f"Denoiser wants 2 x {DENOISER_GPUS:g} GPU, at most 1 can be placed" in warning, warning


def test_the_decoders_share_binds_every_limit_below_the_configured_one(gpu_app):
    client, _ = gpu_app
    limits = _measured_limits(client)
    assert limits["limited_by"] == {"width": "decode", "height": "decode", "frames": "decode", "n": "decode"}, limits
    assert 32 <= limits["width"] < LIMITS.max_width and limits["width"] == limits["height"]
    assert 5 <= limits["frames"] < LIMITS.max_frames and 1 < limits["n"] < LIMITS.max_n
    assert limits["at_size"] == "32x32"


def _refused(response, param: str, *needles: str) -> None:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and "in the decode stage" in error["message"], error
    assert all(n in error["message"] for n in needles), error["message"]


def test_a_request_at_each_limit_is_served_and_one_step_above_is_refused_naming_it(gpu_app):
    client, _ = gpu_app
    limits = _measured_limits(client)
    w, h, frames, n = limits["width"], limits["height"], limits["frames"], limits["n"]
    image = {"prompt": "at the limit", "seed": 1, "num_inference_steps": 1}
    assert client.post("/v1/images/generations", json={**image, "size": f"{w}x{h}"}).status_code == 200
    _refused(client.post("/v1/images/generations", json={**image, "size": f"{w + 16}x{h + 16}"}), "size",
             f"size {w}x{h}")
    assert client.post("/v1/images/generations", json={**image, "size": "32x32", "n": n}).status_code == 200
    _refused(client.post("/v1/images/generations", json={**image, "size": "32x32", "n": n + 1}), "n",
             f"n={n} at this size")
    video = {**image, "size": "32x32", "response_format": "b64_json"}
    served = client.post("/v1/videos/generations", json={**video, "num_frames": frames})
    assert served.status_code == 200 and served.json()["data"][0]["frames"] == frames, served.text[:300]
    _refused(client.post("/v1/videos/generations", json={**video, "num_frames": frames + 4}), "num_frames",
             f"{frames} frames at this size")


def test_a_replica_that_cannot_be_placed_shows_as_pending_with_the_reason(gpu_app):
    client, _ = gpu_app
    _measured_limits(client)  # the app is up: the placed replicas have reported

    def pending():
        return client.get("/v1/residency").json()["pending"]

    (waiting,) = wait_for(pending, 60, "a pending replica in /v1/residency")
    assert waiting["deployment"] == "Denoiser" and waiting["wanted"]["GPU"] == DENOISER_GPUS, waiting
    left = round(1 - DENOISER_GPUS - DECODER_GPUS, 4)
    assert waiting["reason"].startswith(f"wants {DENOISER_GPUS:g} GPU on one GPU; no alive node has it free"), waiting
    assert f"has {left:g} of 1 GPU(s) free" in waiting["reason"], waiting
    replicas = client.get("/v1/residency").json()["replicas"]
    assert sum(r["stage"] == "denoise" for r in replicas) == 1, "the placed Denoiser serves meanwhile"
