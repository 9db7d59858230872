"""Soak: mixed valid and hostile traffic from several clients, one stage replica killed midway.

    python bench/soak.py --quick     # tiny Wan, 30 s of traffic (plus ~1-2 min to start Ray and deploy)
    python bench/soak.py             # 120 s of traffic

Ray is started as `make demo` starts it (loopback head, token auth); the app is the tiny Wan with
a bearer token. Clients send a mix of valid requests and invalid ones (bad JSON, bad fields, wrong
Content-Type, no token); at the midpoint the Denoiser's replica is killed. Prints a table, then
(last line) one JSON object with:
- requests: requests sent;
- non_4xx_failures: answers >= 500 (503 while the killed replica is replaced is expected here);
- lost_requests: accepted (the connection was made, so Serve gave it a request id) but never
  answered: must be 0;
- recovery_s: from the kill to the first 2xx whose denoise ran on the replacement replica;
- leases_outstanding_bytes: bytes the node ledger still holds for the app after it is deleted: must be 0.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import random
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from deployments.dev import local_ray  # noqa: E402

APP, TOKEN_ENV, IMAGES = "soak", "OFFLOAD_SERVE_SOAK_TOKEN", "/v1/images/generations"
OBJECT_STORE_BYTES = 200 * 1024 * 1024
LEASE_WAIT_S = 60  # the ledger reclaims a killed replica's leases once its liveness check sees it gone


@dataclass(frozen=True)
class RequestOutcome:
    kind: str  # "valid" or the kind of invalid request
    started: float  # time.monotonic()
    finished: float
    status: int | None  # None: no answer
    accepted: bool  # the connection was made (Serve's proxy gave the request an id)
    denoise_replica: str | None  # for 2xx: where the denoise ran


def _invalid(kind: str, token: str) -> dict:
    auth = {"Authorization": f"Bearer {token}"}
    if kind == "bad_json":
        return {"content": b'{"prompt": "a", "seed": ' + b"9" * 5000 + b"}", "headers": {**auth, "Content-Type":
                                                                                       "application/json"}}
    if kind == "deep_json":
        return {"content": b"[" * 3000 + b"]" * 3000, "headers": {**auth, "Content-Type": "application/json"}}
    if kind == "bad_field":
        # A lone surrogate as a hostile client sends it: a \\ud800 escape (httpx's json= cannot encode it).
        body = json.dumps({"prompt": "a \ud800 cat", "size": "６４x６４"}, ensure_ascii=True).encode()
        return {"content": body, "headers": {**auth, "Content-Type": "application/json"}}
    if kind == "wrong_type":
        return {"content": b"prompt=a cat", "headers": {**auth, "Content-Type": "text/plain"}}
    return {"json": {"prompt": "no token"}}  # "no_token"


INVALID = ("bad_json", "deep_json", "bad_field", "wrong_type", "no_token")


def client(base: str, token: str, seed: int, stop: threading.Event, out: list[RequestOutcome],
           crashes: list[BaseException]) -> None:
    try:
        _client_loop(base, token, seed, stop, out)
    except BaseException as exc:  # a dead client would quietly shrink the traffic: the run fails instead
        crashes.append(exc)


def _client_loop(base: str, token: str, seed: int, stop: threading.Event, out: list[RequestOutcome]) -> None:
    import httpx

    rng = random.Random(seed)
    with httpx.Client(base_url=base, timeout=httpx.Timeout(120, connect=5)) as c:
        while not stop.is_set():
            kind = "valid" if rng.random() < 0.6 else rng.choice(INVALID)
            request = ({"json": {"prompt": "soak", "seed": rng.randrange(1000), "num_inference_steps": 2},
                        "headers": {"Authorization": f"Bearer {token}"}} if kind == "valid" else _invalid(kind, token))
            started = time.monotonic()
            try:
                response = c.post(IMAGES, **request)
            except httpx.ConnectError:
                out.append(RequestOutcome(kind, started, time.monotonic(), None, False, None))
                continue
            except httpx.HTTPError:
                out.append(RequestOutcome(kind, started, time.monotonic(), None, True, None))
                continue
            replica = None
            if response.status_code == 200:
                replica = next(s["replica"] for s in response.json()["stages"] if s["stage"] == "denoise")
            out.append(RequestOutcome(kind, started, time.monotonic(), response.status_code, True, replica))


def _denoiser_replica() -> str:
    import ray

    prefix = f"SERVE_REPLICA::{APP}#Denoiser#"
    (name,) = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith(prefix)]
    return name


def _app_leases() -> int:
    from cluster.replica.ledger_view import ReplicaMemory

    probe = ReplicaMemory.open("soak-lease-probe", "cpu")
    try:
        leases = probe.host_budget.outstanding() + probe.device_budget.outstanding()
        return sum(lease.nbytes for lease in leases if f"::{APP}#" in lease.owner)
    finally:
        probe.close()


def run(duration_s: float, clients: int) -> dict:
    import ray
    from ray import serve

    from deployments.app import AppArgs, build_app

    token = os.environ.setdefault(TOKEN_ENV, "soak-" + os.urandom(8).hex())
    port = local_ray.free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    args = AppArgs(app_name=APP, api_token_env=TOKEN_ENV, replica_num_cpus=0.0, device_timeout_s=5.0,
                   stage_max_queued_requests=32, graceful_shutdown_timeout_s=30)
    deploy_started = time.monotonic()
    serve.run(build_app(args), name=APP, route_prefix="/")
    deploy_s = time.monotonic() - deploy_started
    victim = _denoiser_replica()
    stop, outcomes, crashes = threading.Event(), [], []
    threads = [threading.Thread(target=client, args=(f"http://127.0.0.1:{port}", token, i, stop, outcomes, crashes))
               for i in range(clients)]
    started = time.monotonic()
    for t in threads:
        t.start()
    time.sleep(duration_s / 2)
    killed_at = time.monotonic()
    ray.kill(ray.get_actor(victim, namespace="serve"), no_restart=True)
    time.sleep(duration_s / 2)
    stop.set()
    for t in threads:
        t.join()
    traffic_s = time.monotonic() - started
    if crashes:
        raise RuntimeError(f"{len(crashes)} client(s) crashed; first: {crashes[0]!r}") from crashes[0]
    recovered = [o.finished for o in outcomes if o.status == 200 and o.denoise_replica not in (None, victim)
                 and o.finished > killed_at]
    serve.delete(APP)
    deadline = time.monotonic() + LEASE_WAIT_S
    while (leases := _app_leases()) and time.monotonic() < deadline:
        time.sleep(1)
    statuses = Counter(o.status for o in outcomes)
    return {
        "requests": len(outcomes),
        "valid_requests": sum(o.kind == "valid" for o in outcomes),
        "ok": statuses[200],
        "4xx": sum(n for s, n in statuses.items() if s is not None and 400 <= s < 500),
        "non_4xx_failures": sum(n for s, n in statuses.items() if s is not None and s >= 500),
        "lost_requests": sum(o.accepted and o.status is None for o in outcomes),
        "recovery_s": round(min(recovered) - killed_at, 2) if recovered else None,
        "leases_outstanding_bytes": leases,
        "statuses": {str(k): v for k, v in sorted(statuses.items(), key=lambda kv: str(kv[0]))},
        "traffic_s": round(traffic_s, 1), "deploy_s": round(deploy_s, 1), "clients": clients,
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="30 s of traffic instead of 120 s")
    parser.add_argument("--clients", type=int, default=4)
    args = parser.parse_args(argv)
    for name, value in (("RAY_USAGE_STATS_ENABLED", "0"), ("HF_HUB_OFFLINE", "1"), ("TRANSFORMERS_OFFLINE", "1")):
        os.environ.setdefault(name, value)
    os.environ.update(local_ray.token_env())  # as `make demo`: Ray's token auth on a loopback head

    import ray
    from ray import serve

    ray_port = local_ray.free_port()
    head = local_ray.start_head(ray_port, OBJECT_STORE_BYTES, dict(os.environ))
    try:
        ray.init(address=f"{local_ray.LOOPBACK}:{ray_port}", namespace="serve", log_to_driver=False)
        result = run(30.0 if args.quick else 120.0, args.clients)
    finally:
        if ray.is_initialized():
            serve.shutdown()
            ray.shutdown()
        local_ray.stop_head(head)
    print(f"{'requests':>10} {'ok':>6} {'4xx':>6} {'>=500':>6} {'lost':>5} {'recovery_s':>11} {'leases_B':>9}")
    print(f"{result['requests']:>10} {result['ok']:>6} {result['4xx']:>6} {result['non_4xx_failures']:>6} "
          f"{result['lost_requests']:>5} {str(result['recovery_s']):>11} {result['leases_outstanding_bytes']:>9}")
    print(f"statuses {result['statuses']}; {result['clients']} clients, {result['traffic_s']} s of traffic, "
          f"deploy {result['deploy_s']} s")
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
