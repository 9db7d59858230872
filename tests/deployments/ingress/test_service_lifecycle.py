"""The service's lifecycle over real Serve, on the shared tiny-Wan app (tests/deployments/conftest.py): a
client that disconnects (plain HTTP or SSE) cancels its request and the Denoiser is free within one step;
a config change deployed under steady traffic loses no request and the replaced replicas give every lease
back (`serve.run` of the changed app goes through the same rolling update as `serve deploy`). The change
(every stage's device timeout) leaves the app serving as before for the shared app's later modules."""
from __future__ import annotations

import threading
import time

import httpx
import pytest

from tests.deployments.conftest import APP, MAX_STEPS, PREFIX, SHARED_OPTIONS, TOKEN, shared_args

IMAGES = "/v1/images/generations"
CLIENTS = 2
# Each client pauses between its requests: back to back, the two sent 77 requests in a 22.2 s update
# (3.3 a second), whose stage calls took the cores from the new replicas starting up. Paced, traffic still
# flows through the old replicas, the update and the new ones.
CLIENT_PAUSE_S = 1.0


# Long enough that a client giving up after 1 s leaves mid-denoise (~5 ms a step here, 2 images).
LONG_STEPS = MAX_STEPS
LONG = {"prompt": "a long walk", "seed": 3, "num_inference_steps": LONG_STEPS, "size": "64x64", "n": 2}


@pytest.fixture(scope="module")
def base(service):
    return service[0]


def _replicas(deployment: str) -> set[str]:
    import ray

    prefix = f"SERVE_REPLICA::{APP}#{deployment}#"
    return {a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith(prefix)}


def _leases_of(replicas: set[str]) -> int:
    """Bytes the node ledger still counts for ``replicas`` (host pool and every device pool)."""
    from cluster.replica.ledger_view import ReplicaMemory

    probe = ReplicaMemory.open("test-lease-probe", "cpu")
    try:
        leases = probe.host_budget.outstanding() + probe.device_budget.outstanding()
        return sum(lease.nbytes for lease in leases if lease.owner in replicas)
    finally:
        probe.close()


def _wait_for(condition, what: str, timeout_s: float = 180.0) -> None:
    """Poll ``condition``; fail naming ``what`` after ``timeout_s`` (a hang would stop the whole suite)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"no {what} within {timeout_s:.0f} s"
        time.sleep(0.1)


def _cancel_metrics(ray_cluster) -> dict[str, dict[str, float]]:
    """The Denoiser's cancellation series, scraped from every node's metrics agent, by series (a replica's
    labels): the shared app's Denoiser may have been replaced, and its old replica's series still be there."""
    urls = [f"http://127.0.0.1:{node.metrics_export_port}/metrics" for node in ray_cluster.list_all_nodes()]
    found: dict[str, dict[str, float]] = {}
    for url in urls:
        for line in httpx.get(url, timeout=10).text.splitlines():
            for name in ("cancelled_requests_total", "steps_after_cancel", "free_seconds_after_cancel"):
                if line.startswith(f"ray_offload_serve_{name}{{") and f'application="{APP}"' in line \
                        and 'stage="denoise"' in line:
                    labels, value = line[len(f"ray_offload_serve_{name}"):].rsplit(" ", 1)
                    found.setdefault(labels, {})[name] = float(value)
    return found


def _counts(series: dict[str, dict[str, float]]) -> dict[str, float]:
    return {labels: values.get("cancelled_requests_total", 0) for labels, values in series.items()}


def _wait_for_cancel(ray_cluster, before: dict[str, float]) -> dict[str, float]:
    """The figures of the series whose cancel count rose above ``before`` (the counts by series before)."""
    # Workers report every 3 s (tests/conftest.py); a scrape every 0.2 s sees a report within 0.2 s of it.
    deadline, found = time.monotonic() + 90, {}
    while time.monotonic() < deadline:
        found = _cancel_metrics(ray_cluster)
        for labels, values in found.items():
            if values.get("cancelled_requests_total", 0) > before.get(labels, 0):
                return values
        time.sleep(0.2)
    raise AssertionError(f"the Denoiser reported {found} cancels, {before} before: the call ran on")


def test_a_plain_http_client_that_disconnects_frees_the_denoiser_within_one_step(base, ray_cluster):
    before = _counts(_cancel_metrics(ray_cluster))  # the shared app's earlier cancels
    headers = {"Authorization": f"Bearer {TOKEN}"}
    # The client must give up mid-denoise: a cancel while the encoder still runs is not the Denoiser's.
    # A fixed 1 s read timeout did that alone, but not in the whole suite (the app's first request's
    # encode took longer, and the Denoiser never counted the cancel): time a warm 2-step request of
    # the same shape and give up twice its lead to the denoise stage, plus 0.5 s (LONG_STEPS take seconds).
    sent = time.time()
    warm = httpx.post(base + IMAGES, json={**LONG, "num_inference_steps": 2}, headers=headers, timeout=120)
    assert warm.status_code == 200, warm.text
    denoise = next(s for s in warm.json()["stages"] if s["stage"] == "denoise")
    give_up_s = max(1.0, 2 * (denoise["started_at"] - sent) + 0.5)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(base + IMAGES, json=LONG, headers=headers, timeout=httpx.Timeout(30, read=give_up_s))
    found = _wait_for_cancel(ray_cluster, before)
    print(f"HTTP disconnect: replica free {found['free_seconds_after_cancel'] * 1e3:.0f} ms after the cancel, "
          f"{found['steps_after_cancel']:.0f} step(s) after the last one seen")
    assert found["steps_after_cancel"] <= 1


def test_an_event_stream_client_that_disconnects_frees_the_denoiser_within_one_step(base, ray_cluster):
    before = _counts(_cancel_metrics(ray_cluster))
    headers = {"Authorization": f"Bearer {TOKEN}"}
    with httpx.Client(base_url=base, headers=headers, timeout=60) as client:
        with client.stream("POST", IMAGES, json={**LONG, "stream": True}) as response:
            progress = 0
            for line in response.iter_lines():
                progress += line.startswith("event: progress")
                if progress == 3:
                    break  # leaving the block closes the connection mid-stream
    found = _wait_for_cancel(ray_cluster, before)
    print(f"SSE disconnect: replica free {found['free_seconds_after_cancel'] * 1e3:.0f} ms after the cancel, "
          f"{found['steps_after_cancel']:.0f} step(s) after the last one seen")
    assert found["steps_after_cancel"] <= 1
    # And the replica serves the next request.
    ok = httpx.post(base + IMAGES, json={"prompt": "next", "num_inference_steps": 2}, headers=headers, timeout=120)
    assert ok.status_code == 200, ok.text


def test_a_config_change_under_steady_traffic_loses_no_request_and_gives_every_lease_back(base):
    from ray import serve

    from deployments.app import build_app_with

    # Every stage's device timeout, 1 s -> 1.5 s: each stage replica's arguments change, so Serve replaces
    # them all, and the app serves as before for the shared app's later modules.
    changed = shared_args()
    changed = changed.model_copy(update={"device_timeout_s": changed.device_timeout_s + 0.5})

    old_stages = _replicas("Denoiser") | _replicas("TextEncoder") | _replicas("VaeDecoder")
    assert _leases_of(old_stages) > 0, "the old replicas hold no lease: nothing to give back"
    stop, results = threading.Event(), []

    def client(seed: int) -> None:
        with httpx.Client(base_url=base, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=120) as c:
            while not stop.is_set():
                try:
                    response = c.post(IMAGES, json={"prompt": "steady", "seed": seed, "num_inference_steps": 4,
                                                    "size": "32x32"})
                    results.append((time.monotonic(), response.status_code, response.text[:200]))
                except httpx.HTTPError as error:  # a lost request is a failure to report, not a dead client
                    results.append((time.monotonic(), None, f"{type(error).__name__}: {error}"))
                stop.wait(CLIENT_PAUSE_S)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(CLIENTS)]
    for t in threads:
        t.start()
    try:
        _wait_for(lambda: len(results) >= 4, "traffic through the old replicas")
        started = time.monotonic()
        serve.run(build_app_with(changed, SHARED_OPTIONS), name=APP, route_prefix=PREFIX)  # the change
        updated = time.monotonic()
        _wait_for(lambda: sum(1 for at, _, _ in results if at > updated) >= 4, "traffic through the new replicas")
    finally:
        stop.set()
        for t in threads:
            t.join()
    during = [(status, text) for at, status, text in results if at >= started]
    failures = [(status, text) for _, status, text in results if status != 200]
    print(f"{len(results)} requests, {len(during)} answered during/after the {updated - started:.1f} s update, "
          f"{len(failures)} failed")
    assert failures == [], failures
    assert during, "no request was answered while the update ran"
    new_stages = _replicas("Denoiser") | _replicas("TextEncoder") | _replicas("VaeDecoder")
    assert new_stages and not (new_stages & old_stages), "the stage replicas were not replaced"
    deadline = time.monotonic() + 30  # a drained replica's close() runs after its last request
    while _leases_of(old_stages) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _leases_of(old_stages) == 0, "a replaced replica kept its leases"
