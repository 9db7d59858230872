"""The tiny Wan service over real Ray Serve and HTTP: outputs, bad input, overload. (A Denoiser killed mid-request:
ingress/test_video_jobs_service.py, on the same shared app, kills it once for a request and a job.)"""
from __future__ import annotations

import base64
import concurrent.futures
import io
import json
import pathlib
import time
import urllib.request

import httpx
import numpy as np
import pytest
import ray
import torch
from PIL import Image

from deployments.models import families
from deployments.wire import media
from deployments.wire.spec import GenerationSpec
from tests.deployments.conftest import APP, MAX_STEPS, REPLICA_NICENESS, SHARED_LORA
from tests.k8s.test_dashboard import queried_metrics
from zoo.tiny import ensure_tiny_wan

IMAGES, VIDEOS = "/v1/images/generations", "/v1/videos/generations"


@pytest.fixture(scope="module")
def client(service):
    base, headers = service
    with httpx.Client(base_url=base, headers=headers, timeout=120) as c:
        yield c


def response_pngs(response) -> list[bytes]:
    assert response.status_code == 200, response.text
    return [base64.b64decode(item["b64_json"]) for item in response.json()["data"]]


def test_an_image_request_returns_decodable_pngs_of_the_asked_size(client):
    sent_at = time.time()
    response = client.post(IMAGES, json={"prompt": "a red fox", "size": "32x16", "n": 2, "seed": 4})
    pngs = response_pngs(response)
    assert len(pngs) == 2
    for png in pngs:
        image = Image.open(io.BytesIO(png))
        assert (image.format, image.size, image.mode) == ("PNG", (32, 16), "RGB")
    stages = [s["stage"] for s in response.json()["stages"]]
    assert stages == ["encode", "denoise", "decode"]
    assert response.json()["stages"][1]["bytes_streamed"] > 0, "the denoiser's layers were not streamed"
    # Each stage's call on the request's timeline (bench/serve.py splits requests into hops on it):
    # after the request was sent, each after the call whose output it takes had ended.
    calls = [(s["started_at"], s["started_at"] + s["seconds"]) for s in response.json()["stages"]]
    assert sent_at <= calls[0][0] and all(end <= after for (_, end), (after, _) in zip(calls, calls[1:])), calls


def test_the_same_seed_gives_the_same_bytes_and_another_seed_does_not(client):
    body = {"prompt": "a lighthouse", "seed": 99, "num_inference_steps": 2}
    first, second = response_pngs(client.post(IMAGES, json=body)), response_pngs(client.post(IMAGES, json=body))
    other = response_pngs(client.post(IMAGES, json={**body, "seed": 100}))
    assert first == second
    assert first != other


def test_http_pngs_equal_the_in_process_pipeline_pngs(client):
    response = client.post(IMAGES, json={"prompt": "a cat on a mat", "negative_prompt": "blur", "size": "16x32",
                                         "n": 2, "seed": 5, "num_inference_steps": 3, "guidance_scale": 4.0})
    facts = families.read_family_traits(ensure_tiny_wan())
    spec = GenerationSpec("r", "a cat on a mat", "blur", 32, 16, 1, 3, 4.0, 5, 2)
    reference = families.reference_frames(families.load_full_pipeline(facts, torch.float32), facts, spec)
    assert response_pngs(response) == [media.png_bytes(frames[0]) for frames in reference]


def test_stage_handles_compose_to_the_in_process_result(service):
    from ray import serve

    spec = GenerationSpec("bitwise", "a blue whale", "dark", 16, 16, 5, 2, 5.0, 21, 1)
    encoder = serve.get_deployment_handle("TextEncoder", app_name=APP)
    denoiser = serve.get_deployment_handle("Denoiser", app_name=APP)
    decoder = serve.get_deployment_handle("VaeDecoder", app_name=APP)
    encoded = encoder.encode.remote(spec)
    items = list(denoiser.options(stream=True).denoise.remote(encoded, spec))
    assert [(p.step, p.total) for p in items[:-1]] == [(1, 2), (2, 2)]
    frames = decoder.decode.remote(items[-1], spec).result(timeout_s=120).value
    facts = families.read_family_traits(ensure_tiny_wan())
    reference = families.reference_frames(families.load_full_pipeline(facts, torch.float32), facts, spec)
    # The Denoiser batches guidance's two branches into one forward (tests/deployments/
    # test_batching.py pins bitwise equality with the plain model on the same batches); the
    # pipeline runs them as two forwards, so the frames agree to rounding, not bitwise: measured
    # 4.8e-7 at most on the tiny zoo.
    torch.testing.assert_close(frames, reference, rtol=0, atol=1e-5)


def test_a_video_request_returns_a_decodable_mp4(client):
    import imageio.v3 as iio

    response = client.post(VIDEOS, json={"prompt": "waves", "size": "32x32", "num_frames": 5, "seed": 2,
                                         "response_format": "mp4"})
    assert response.status_code == 200 and response.headers["content-type"] == "video/mp4"
    frames = iio.imread(response.content, extension=".mp4", plugin="FFMPEG")
    assert frames.shape == (5, 32, 32, 3)
    as_json = client.post(VIDEOS, json={"prompt": "waves", "size": "32x32", "num_frames": 5, "seed": 2})
    assert base64.b64decode(as_json.json()["data"][0]["b64_json"]) == response.content


def test_a_streaming_client_sees_denoising_step_k_of_n_a_preview_then_the_image(client):
    with client.stream("POST", IMAGES, json={"prompt": "a tree", "stream": True, "num_inference_steps": 3,
                                             "seed": 1, "partial_images": 1}) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        text = "".join(response.iter_text())
    events = [(block.split("\n")[0][len("event: "):], json.loads(block.split("\n")[1][len("data: "):]))
              for block in text.strip().split("\n\n")]
    names = [name for name, _ in events]
    assert names == ["accepted", "progress", "progress", "image_generation.partial_image", "progress",
                     "image_generation.completed"]
    assert [data["message"] for name, data in events if name == "progress"] == \
        ["step 1 of 3", "step 2 of 3", "step 3 of 3"]
    plain = response_pngs(client.post(IMAGES, json={"prompt": "a tree", "num_inference_steps": 3, "seed": 1}))
    assert [base64.b64decode(events[-1][1]["b64_json"])] == plain, "a preview changes nothing in the image"
    # The preview: the Denoiser's estimate after step 2, decoded by the VaeDecoder replica.
    preview = base64.b64decode(events[3][1]["b64_json"])
    assert Image.open(io.BytesIO(preview)).size == Image.open(io.BytesIO(plain[0])).size and preview != plain[0]
    assert (events[3][1]["partial_image_index"], events[3][1]["step"]) == (0, 2)


@pytest.mark.parametrize("body, param, status", [
    ({"prompt": "a cat", "size": "24x16"}, "size", 400),
    ({"prompt": "a cat", "size": "128x128"}, "size", 400),
    ({"prompt": "a cat", "num_inference_steps": MAX_STEPS + 1}, "num_inference_steps", 400),
    ({"prompt": "a cat", "num_inference_steps": 0}, "num_inference_steps", 400),
    ({"prompt": "a cat", "n": 9}, "n", 400),
    ({"prompt": ""}, "prompt", 400),
    ({"prompt": "p" * 500}, "prompt", 400),
    ({"prompt": "a cat", "model": "dall-e-3"}, "model", 404),
    ({"prompt": "a cat", "response_format": "url"}, "response_format", 400),
    ({"prompt": "a cat", "style": "vivid"}, "style", 400),
    ([1, 2], "body", 400),
])
def test_a_bad_field_gets_a_4xx_json_error_naming_it(client, body, param, status):
    response = client.post(IMAGES, json=body)
    assert response.status_code == status, response.text
    assert response.json()["error"]["param"] == param


def test_a_body_that_is_not_json_gets_400_naming_the_body(client):
    response = client.post(IMAGES, content=b"prompt=a cat", headers={"content-type": "application/json"})
    assert response.status_code == 400 and response.json()["error"]["param"] == "body"


def test_requests_without_the_bearer_token_get_401_but_health_does_not(service):
    base, _ = service
    assert httpx.post(base + IMAGES, json={"prompt": "a cat"}).status_code == 401
    wrong = httpx.get(base + "/v1/models", headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401 and wrong.json()["error"]["param"] == "authorization"
    assert httpx.get(base + "/health").json()["status"] == "ok"


def test_models_and_residency_describe_the_served_model_and_every_replica(client):
    assert client.post(IMAGES, json={"prompt": "a request to report on", "seed": 1}).status_code == 200
    (model,) = client.get("/v1/models").json()["data"]
    assert (model["id"], model["family"], model["modalities"]) == ("tiny-wan", "wan", ["image", "video", "image-edit",
                                                                         "video-edit"])
    # Replicas publish their report after the response has left; the Denoiser's batch size goes on its
    # own, within a second of its change (it read 1, not 0, in one run that waited for the report alone).
    deadline = time.monotonic() + 30
    while True:
        replicas = client.get("/v1/residency").json()["replicas"]
        denoiser = next((r for r in replicas if r["stage"] == "denoise"), None)
        settled = denoiser and denoiser["last_device_peak_bytes"] and denoiser["batch"]["size"] == 0
        if settled or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert sorted(r["stage"] for r in replicas) == ["decode", "denoise", "encode"]
    (component,) = denoiser["weights"]["components"]
    # Memory mode streams all 4 blocks: their weights wait on the host between calls.
    assert component["name"] == "transformer" and sum(component["layer_tiers"].values()) == 4, component
    host_bytes = ("host_pinned_bytes", "host_pageable_bytes", "host_mapped_bytes", "host_shared_bytes")
    assert sum(component[k] for k in host_bytes) > 0
    assert any(line.startswith("transformer: ") for line in denoiser["plan"]), denoiser["plan"]
    # Every replica's plan says it was made from its warm-up: measured compute, a working set kept.
    for replica in replicas:
        assert "GiB kept for activations" in replica["plan"][0], replica["plan"]
        assert any(line.startswith("planned from a warm-up at 16x16x5 (1 step): compute per use ")
                   for line in replica["plan"]), replica["plan"]
    assert denoiser["last_device_peak_bytes"] == denoiser["predicted_peak_bytes"]
    host = denoiser["host_memory"]  # the config's 64MiB host_memory_budget, what it leased and holds
    assert host["budget_bytes"] == 64 * 1024**2 and host["leased_bytes"] <= host["budget_bytes"]
    assert host["used_bytes"] >= host["leased_bytes"], "what a lease paid for is held on the host"
    (store,) = host["shared"]  # its streamed layers come from the node weight store
    assert store["component"] == "transformer" and store["attached"] >= 1 and store["bytes"] > 0
    assert store["share_bytes"] == store["bytes"] // store["attached"]
    assert component["host_shared_bytes"] > 0 and component["host_pinned_bytes"] == 0
    assert next(r for r in replicas if r["stage"] == "encode")["host_memory"]["budget_bytes"] is None
    # Only the Denoiser batches; between requests its batch is empty.
    assert denoiser["batch"]["max"] == 4 and denoiser["batch"]["size"] == 0
    assert all("batch" not in r for r in replicas if r["stage"] != "denoise")


def test_stage_metrics_reach_prometheus_with_a_series_per_stage(client, ray_cluster):
    client.post(IMAGES, json={"prompt": "metrics", "seed": 1})
    # Replicas may land on any node of the session's cluster (other modules add GPU nodes), and
    # each node's metrics agent exports only what its own workers recorded: scrape them all.
    urls = [f"http://127.0.0.1:{node.metrics_export_port}/metrics" for node in ray_cluster.list_all_nodes()]
    wanted = {f'ray_offload_serve_{name}{{' for name in ("stage_latency_seconds_count",
                                                        "bytes_streamed_per_request_count",
                                                        "device_peak_bytes")}
    # The Denoiser's step batching: requests per forward, queue wait, step time.
    batching = {f'ray_offload_serve_{name}_count{{' for name in ("batch_size", "batch_queue_wait_seconds",
                                                                "step_seconds")}
    wanted |= batching
    deadline, seen = time.monotonic() + 60, set()
    while time.monotonic() < deadline and seen != wanted:
        lines = [line for url in urls for line in httpx.get(url, timeout=10).text.splitlines()]
        seen = {w for w in wanted for line in lines
                if line.startswith(w) and (w in batching or 'stage="denoise"' in line)}
        time.sleep(1)
    assert seen == wanted, f"missing from Prometheus: {wanted - seen}"


def test_each_replicas_decisions_are_in_its_serve_log(client, ray_cluster):
    # Serve configures only its own logger in a replica: before deployments/replica/logs.py not one
    # plan, lease or routing line of the project reached any log (CI's session logs at 9c6cdb9).
    response_pngs(client.post(IMAGES, json={"prompt": "logged", "num_inference_steps": 2}))
    serve_logs = pathlib.Path(ray_cluster.head_node.get_logs_dir_path()) / "serve"

    def lines(deployment: str) -> str:
        return "".join(path.read_text() for path in serve_logs.glob(f"replica_{APP}_{deployment}_*.log"))

    denoiser, ingress = lines("Denoiser"), lines("Ingress")
    assert "plan on cpu" in denoiser and "standing device lease" in denoiser, denoiser[-2000:]
    # AppArgs.replica_niceness reached the replica's process (Ray would have started it at 15).
    assert f"process: nice {REPLICA_NICENESS}," in denoiser, denoiser[-2000:]
    assert "ingress for" in ingress, ingress[-2000:]
    assert "-> Denoiser replica" in ingress, "the router's line per routed request, in the ingress's log"


def test_a_request_naming_the_served_adapter_gets_its_own_image_and_an_unknown_one_a_404(client):
    (card,) = client.get("/v1/models").json()["data"]
    assert card["loras"] == [{"name": SHARED_LORA, "scale": 1.0}]
    body = {"prompt": "a red fox", "seed": 5, "num_inference_steps": 2}
    plain = response_pngs(client.post(IMAGES, json=body))
    inked = response_pngs(client.post(IMAGES, json={**body, "lora": SHARED_LORA}))
    assert inked != plain, "the adapter changes the image"
    assert response_pngs(client.post(IMAGES, json={**body, "lora": SHARED_LORA})) == inked  # deterministic
    assert response_pngs(client.post(IMAGES, json=body)) == plain  # and leaves the next request alone
    refused = client.post(IMAGES, json={**body, "lora": "../ink"})
    assert refused.status_code == 404 and refused.json()["error"]["param"] == "lora", refused.text


def test_concurrent_requests_all_succeed_with_their_own_results(client):
    bodies = [{"prompt": f"scene {i}", "seed": i, "num_inference_steps": 2} for i in range(3)]
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        together = list(pool.map(lambda b: response_pngs(client.post(IMAGES, json=b)), bodies))
    alone = [response_pngs(client.post(IMAGES, json=b)) for b in bodies]
    # Requests that shared a batched forward agree with their lone runs to rounding (< 1e-6 in
    # float): at most one level of 255 in a PNG.
    for shared, single in zip(together, alone):
        for a, b in zip(shared, single):
            assert np.abs(_pixels(a).astype(int) - _pixels(b).astype(int)).max() <= 1


def _pixels(png: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(png)))


def test_each_replicas_plan_picture_shows_its_predicted_and_its_measured_pass(client):
    replicas = {r["stage"]: r["replica"] for r in client.get("/v1/residency").json()["replicas"]}
    svg = client.get("/v1/residency/picture", params={"replica": replicas["denoise"]})
    assert svg.status_code == 200 and svg.headers["content-type"].startswith("image/svg+xml"), svg.text
    # Memory mode streams the transformer: the strip and both passes, the measured one from its warm-up.
    for text in (b"transformer: layerwise: 0/4 resident", b"transformer, predicted: one pass",
                 b"transformer, measured (warm-up): one pass", b"copy stream"):
        assert text in svg.content, text
    assert client.get("/v1/residency/picture", params={"replica": "nope"}).status_code == 404


def test_concurrent_denoise_calls_share_forwards_and_each_gets_its_own_latents(service):
    from ray import serve

    encoder = serve.get_deployment_handle("TextEncoder", app_name=APP)
    denoiser = serve.get_deployment_handle("Denoiser", app_name=APP)
    specs = [GenerationSpec(f"batch-{i}", f"scene {i}", None, 16, 16, 1, 4, 5.0, i, 1) for i in range(3)]
    encoded = [encoder.encode.remote(s).result(timeout_s=60) for s in specs]
    alone = [list(denoiser.options(stream=True).denoise.remote(e, s))[-1] for e, s in zip(encoded, specs)]
    streams = [denoiser.options(stream=True).denoise.remote(e, s) for e, s in zip(encoded, specs)]
    together = [list(stream)[-1] for stream in streams]
    for shared, single in zip(together, alone):
        torch.testing.assert_close(shared.value, single.value, rtol=0, atol=1e-5)
    # Sent at once, they join one batch (at worst one step apart): the weights stream once per
    # shared forward, so together they move fewer bytes than one after another.
    assert sum(t.stats.bytes_streamed for t in together) < sum(a.stats.bytes_streamed for a in alone)


def test_beyond_the_queue_requests_get_503_with_retry_after_never_500(client):
    bodies = [{"prompt": f"burst {i}", "seed": i, "num_inference_steps": 4, "size": "64x64"} for i in range(16)]
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        responses = list(pool.map(lambda b: client.post(IMAGES, json=b), bodies))
    codes = sorted(r.status_code for r in responses)
    assert set(codes) <= {200, 503}, codes
    assert 503 in codes and 200 in codes, codes
    for r in responses:
        if r.status_code == 503:
            assert int(r.headers["retry-after"]) >= 1 and r.json()["error"]["code"] == "queue_full"


def test_a_device_held_elsewhere_gets_503_with_retry_after_then_serves_when_freed(client):
    """Neighbours holding the node ledger's whole device pool: the stage waits its 1 s, then 503."""
    from cluster.replica.ledger_view import ReplicaMemory

    held = []  # the ledger caps each owner at a share of the pool, so it takes a few neighbours
    try:
        for i in range(8):
            neighbour = ReplicaMemory.open(f"test-neighbour-{i}", "cpu")
            pool = neighbour.device_budget
            got = pool.request(pool.available(), neighbour.owner)
            got = got or pool.request(got.available, neighbour.owner)
            held.append((neighbour, got))
            if pool.available() < 1024:
                break
        assert pool.available() < 1024, "the neighbours could not fill the device pool"
        # The stages keep their call leases between calls as reservations: a neighbour that waits
        # for bytes makes the ledger recall them, and the stages give them back.
        reserved = sum(lease.nbytes for lease in pool.outstanding() if lease.recallable)
        assert reserved > 0, "the stages served earlier requests, so they hold reservations"
        taker = ReplicaMemory.open("test-neighbour-taker", "cpu")
        held.append((taker, taker.device_budget.acquire(reserved, taker.owner, wait_s=30)))
        assert held[-1][1], f"the recalled reservations were not given back: {held[-1][1]}"
        busy = client.post(IMAGES, json={"prompt": "while busy", "seed": 1})
        assert busy.status_code == 503, busy.text
        assert busy.json()["error"]["code"] == "device_busy" and int(busy.headers["retry-after"]) >= 1
    finally:
        for neighbour, lease in held:
            if lease:
                neighbour.device_budget.release(lease)
            neighbour.close()
    assert client.post(IMAGES, json={"prompt": "when free", "seed": 1}).status_code == 200


def _lease_figures(client, calls_at_least: dict | None = None) -> dict:
    """Each stage's published lease figures, once every stage reports at least ``calls_at_least`` calls."""
    deadline = time.monotonic() + 30  # reports are published after the response, at most once a second
    while True:
        leases = {r["stage"]: r["leases"] for r in client.get("/v1/residency").json()["replicas"]}
        if calls_at_least is None or all(leases[s]["calls"] >= n for s, n in calls_at_least.items()):
            return leases
        assert time.monotonic() < deadline, f"reports never showed {calls_at_least} calls: {leases}"
        time.sleep(0.2)


def _settled_lease_figures(client) -> dict:
    """Each stage's lease figures once its reports stop changing: a replica publishes at most once
    per PUBLISH_INTERVAL_S and always publishes its last state within it and the settle (+0.5 s for
    the board)."""
    from deployments.replica.worker import PUBLISH_INTERVAL_S, PUBLISH_SETTLE_S

    deadline, last = time.monotonic() + 30, _lease_figures(client)
    while True:
        time.sleep(PUBLISH_INTERVAL_S + PUBLISH_SETTLE_S + 0.5)
        now = _lease_figures(client)
        if now == last:
            return now
        assert time.monotonic() < deadline, f"reports kept changing: {last} -> {now}"
        last = now


def test_back_to_back_requests_reuse_their_call_reservations_without_ledger_round_trips(client):
    body = {"prompt": "again and again", "seed": 3, "num_inference_steps": 2}
    assert client.post(IMAGES, json=body).status_code == 200  # the first of this shape may grow a reservation
    before = _settled_lease_figures(client)  # with that first request's calls counted
    for _ in range(3):
        assert client.post(IMAGES, json=body).status_code == 200
    after = _lease_figures(client, {stage: f["calls"] + 3 for stage, f in before.items()})
    assert set(after) == {"encode", "denoise", "decode"}
    for stage in after:
        fast = after[stage]["calls_without_round_trip"] - before[stage]["calls_without_round_trip"]
        assert fast == after[stage]["calls"] - before[stage]["calls"] >= 3, (stage, before[stage], after[stage])
        assert after[stage]["given_back"] == before[stage]["given_back"], (stage, before[stage], after[stage])
    # The denoiser streams every layer (memory mode): its calls add slots and activations, kept as a
    # reservation; the resident encoder keeps its weights under its standing lease.
    assert after["denoise"]["reserved_bytes"] > 0 and after["encode"]["standing_bytes"] > 0
    # The headroom by part, measured when the report was built (a CPU device: its capacity, no cache).
    assert {"driver_free_bytes", "largest_cached_block_bytes", "neighbours_outstanding_bytes"} <= set(
        after["denoise"]["headroom"]), after["denoise"]


def replica_name(deployment: str):
    prefix = f"SERVE_REPLICA::{APP}#{deployment}#"
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith(prefix)]
    assert len(names) == 1, names
    return names[0]


def sse_events(response):
    """(event, data) pairs of a Server-Sent Events response, as they arrive."""
    name = None
    for line in response.iter_lines():
        if line.startswith("event: "):
            name = line[len("event: "):]
        elif line.startswith("data: "):
            yield name, json.loads(line[len("data: "):])


# Ray's metrics agent exports what replicas recorded every few seconds (metrics_report_interval_ms).
SCRAPE_TIMEOUT_S = 120


def _exported() -> set[str]:
    """Metric names every alive node's metrics agent exports now (Prometheus text)."""
    names = set()
    for node in ray.nodes():
        if node["Alive"]:
            url = f"http://{node['NodeManagerAddress']}:{node['MetricsExportPort']}/metrics"
            text = urllib.request.urlopen(url, timeout=10).read().decode()
            names |= {line.split("{")[0].split(" ")[0] for line in text.splitlines()
                      if line and not line.startswith("#")}
    return names


def test_every_metric_the_grafana_dashboard_queries_is_exported_by_the_running_service(client):
    # k8s/grafana.py's queries against what Ray's metrics agents export once the service served requests:
    # the second after the Denoiser's routing stats (polled every routing_stats_period_s, 1 s) carry the
    # first one's step times, so the router predicts its finish (the predicted-vs-actual panel's metrics).
    for seed in (1, 2):
        response = client.post(IMAGES, json={"prompt": "a fox", "size": "16x16", "seed": seed})
        assert response.status_code == 200, response.text
        time.sleep(1.5)
    wanted = queried_metrics()
    deadline, missing = time.monotonic() + SCRAPE_TIMEOUT_S, wanted
    while missing and time.monotonic() < deadline:
        exported = _exported()
        missing = wanted - exported
        if missing:
            time.sleep(3)
    assert not missing, (f"the dashboard queries metrics the service does not export: {sorted(missing)}; "
                         f"exported ray_serve/offload ones: {sorted(n for n in exported if 'serve' in n)}")
