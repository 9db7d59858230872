"""The tiny Wan service with its text encoder over 2 gloo ranks (tp_size 2) on real Ray Serve.

One app for the module: the image it answers equals the in-process pipeline's (what tp_size 1
answers), each rank shows its own residency with the sharded token table kept on the device, and a
rank killed mid-call fails that call with 503 before Serve replaces the replica.
"""
from __future__ import annotations

import concurrent.futures
import os
import signal
import time

import httpx
import pytest
import torch

from deployments.app import StageArgs, build_app, build_app_with, tp_options
from deployments.models import families
from deployments.models.tensor_parallel import NoStagePlan
from deployments.wire.spec import GenerationSpec
from tests.deployments.conftest import TOKEN, TOKEN_ENV, delete_app, serve_base_url, tiny_args
from tests.waiting import wait_for
from zoo.tiny import ensure_tiny_wan

APP, PREFIX = "tp-test", "/tp"
IMAGES = "/v1/images/generations"
# Host tables asked for at any size: only the tensor-parallel rule keeps the table on the device.
TP_ENCODER = StageArgs(tp_size=2, host_tables_min_bytes=0)


def test_a_stage_without_a_plan_refuses_tp_size_2_naming_what_has_plans(monkeypatch):
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    with pytest.raises(NoStagePlan, match=r"transformer \(WanTransformer3DModel\) has no tensor-parallel plan; "
                                          r"plans exist for \['FluxTransformer2DModel', 'QwenImageTransformer2DModel', "
                                          r"'T5EncoderModel', 'UMT5EncoderModel'\]"):
        build_app(tiny_args(app_name=APP, denoiser=StageArgs(tp_size=2)))


def test_tp_size_becomes_one_strictly_packed_bundle_per_rank_and_1_is_todays_options():
    base = {"ray_actor_options": {"num_cpus": 0.5}, "max_ongoing_requests": 1}
    assert tp_options("TextEncoder", base, StageArgs()) == base
    gpu = tp_options("TextEncoder", base, StageArgs(tp_size=2, tp_device="gpu"))
    assert gpu["placement_group_bundles"] == [{"CPU": 1.0, "GPU": 1}, {"CPU": 0.5, "GPU": 1}]
    assert gpu["placement_group_strategy"] == "STRICT_PACK" and gpu["ray_actor_options"]["num_gpus"] == 0
    cpu = tp_options("TextEncoder", base, StageArgs(tp_size=2, tp_device="cpu"))
    assert cpu["placement_group_bundles"] == [{"CPU": 1.0}, {"CPU": 0.5}]


@pytest.fixture(scope="module")
def tp_service(ray_cluster):
    from ray import serve

    os.environ[TOKEN_ENV] = TOKEN
    base = serve_base_url(ray_cluster)
    # A health check every 0.3 s: Serve replaces a replica after 3 failed checks in a row, so a broken
    # group's replica is replaced ~1 s after the rank died (3.2 s at a check every second).
    app = build_app_with(tiny_args(app_name=APP, encoder=TP_ENCODER),
                         {"TextEncoder": {"health_check_period_s": 0.3, "health_check_timeout_s": 30.0}})
    serve.run(app, name=APP, route_prefix=PREFIX)
    try:
        with httpx.Client(base_url=base + PREFIX, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=120) as c:
            yield c
    finally:
        delete_app(APP)


def _encoder():
    from ray import serve

    return serve.get_deployment_handle("TextEncoder", app_name=APP)


def _encoder_ongoing() -> int:
    """Requests the TextEncoder replica holds now (Serve's own count: its router asks each replica)."""
    import ray

    prefix = f"SERVE_REPLICA::{APP}#TextEncoder#"
    (name,) = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith(prefix)]
    return ray.get(ray.get_actor(name, namespace="serve").get_num_ongoing_requests.remote(), timeout=30)


def test_the_encoder_at_tp_2_answers_the_in_process_result_with_each_rank_keeping_its_table_shard(tp_service):
    from ray import serve

    spec = GenerationSpec("tp", "a blue whale", "dark", 16, 16, 5, 2, 5.0, 21, 1)
    encoded = _encoder().encode.remote(spec)
    items = list(serve.get_deployment_handle("Denoiser", app_name=APP).options(stream=True)
                 .denoise.remote(encoded, spec))
    frames = serve.get_deployment_handle("VaeDecoder", app_name=APP).decode.remote(items[-1], spec).result(
        timeout_s=120).value
    facts = families.read_family_traits(ensure_tiny_wan())
    pipe = families.load_full_pipeline(facts, torch.float32)
    reference = families.reference_frames(pipe, facts, spec)
    diff = (frames - reference).abs().max().item()
    print(f"tp 2 frames vs the in-process (tp 1) frames: max |diff| = {diff:.3g}")
    torch.testing.assert_close(frames, reference, rtol=0, atol=1e-5)
    reports = {r["replica"]: r for r in tp_service.get("/v1/residency").json()["replicas"] if r["stage"] == "encode"}
    assert sorted(name.rsplit("/", 1)[-1] for name in reports) == ["rank0", "rank1"], sorted(reports)
    whole = sum(p.numel() * p.element_size() for p in pipe.text_encoder.parameters())
    for name, report in reports.items():
        [encoder] = report["weights"]["components"]
        [table] = encoder["tables"]
        assert (table["path"], table["verdict"]) == ("shared", "sharded"), (name, table)
        assert "tensor-parallel" in table["reason"]
        # Each rank holds about half: its table and FFN/attention slices (the norms are whole on both).
        assert encoder["device_bytes"] <= 0.55 * whole, (name, encoder["device_bytes"], whole)
        assert encoder["host_pinned_bytes"] + encoder["host_pageable_bytes"] + encoder["host_mapped_bytes"] < 0.01 * whole


def test_a_rank_killed_mid_call_fails_the_call_with_503_and_the_replica_is_replaced(tp_service):
    """Last in the module: the replacement replica starts two ranks again (tens of seconds here)."""
    from cluster.ledger.actor import node_ledger

    body = {"prompt": "a storm", "seed": 3, "num_inference_steps": 2, "size": "16x16"}
    expected = tp_service.post(IMAGES, json=body)
    assert expected.status_code == 200, expected.text
    ranks = _encoder().ranks.remote().result(timeout_s=30)
    victims = {r["replica"] for r in tp_service.get("/v1/residency").json()["replicas"] if r["stage"] == "encode"}
    # Rank 1 stopped: rank 0 runs into its first collective and waits there; then rank 1 dies. The kill
    # waits for the call to be in the replica (Serve counts it ongoing there: a fixed 3 s wait did not
    # say so on a loaded machine), and 0.5 s more for rank 0 to reach its collective (the embedding's).
    os.kill(ranks[1].pid, signal.SIGSTOP)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pending = pool.submit(tp_service.post, IMAGES, json={**body, "seed": 4})
        wait_for(lambda: _encoder_ongoing() >= 1 or pending.done(), 60, "the encode call in the TP replica")
        time.sleep(0.5)
        assert not pending.done(), "the call finished with a rank stopped"
        os.kill(ranks[1].pid, signal.SIGKILL)
        failed = pending.result(timeout=60)
    assert failed.status_code == 503 and "retry-after" in failed.headers, failed.text
    assert failed.json()["error"]["code"] == "replica_unavailable", failed.json()
    deadline, later = time.monotonic() + 240, None
    while time.monotonic() < deadline:
        later = tp_service.post(IMAGES, json=body)
        if later.status_code == 200:
            break
        assert later.status_code == 503, later.text
        time.sleep(0.5)
    assert later.status_code == 200 and later.json()["data"] == expected.json()["data"]
    assert {r.pid for r in _encoder().ranks.remote().result(timeout_s=30)}.isdisjoint({r.pid for r in ranks})
    listed = {r["replica"] for r in tp_service.get("/v1/residency").json()["replicas"] if r["stage"] == "encode"}
    assert listed and listed.isdisjoint(victims), (listed, victims)
    import ray

    ledger = node_ledger()
    for victim in victims:  # every lease of the dead replica's ranks came back
        deadline = time.monotonic() + 30
        while ray.get(ledger.outstanding.remote(owner=victim)) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not ray.get(ledger.outstanding.remote(owner=victim)), victim
