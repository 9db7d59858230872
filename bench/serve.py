"""Latency of the split-stage service vs. the same pipeline in-process, and throughput by concurrency.

    python bench/serve.py --quick      # tiny Wan, < 60 s on 2 CPUs (most of it is deploying)
    python bench/serve.py --medium     # the ~300 MB medium Wan denoiser

Prints a table, then (last line) one JSON object. Three latencies side by side, same request:
- in-process: the plain diffusers pipeline + PNG encoding (the baseline);
- in-process offloaded: the three stages under offload_core in one process (the engine's cost);
- service: POST /v1/images/generations over HTTP through Ray Serve (engine + Ray + HTTP).
The in-process pipeline and the service are timed alternately, request by request, so a load
that comes and goes on a shared machine weighs on both alike; medians are compared.

Then where the service's overhead goes, per hop: each stage called through its Serve handle
from this process (the Ray hop = handle wall time - the replica's own stage time), and the rest
(HTTP, the ingress, PNG). The replicas' lease figures say how many calls went without a ledger
round trip.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import os
import pathlib
import socket
import statistics
import sys
import time

for _name, _value in (("RAY_USAGE_STATS_ENABLED", "0"), ("HF_HUB_OFFLINE", "1"),
                      ("TRANSFORMERS_OFFLINE", "1")):
    os.environ.setdefault(_name, _value)
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from deployments.dev import local_ray  # noqa: E402

local_ray.use_token_auth()  # before Ray is imported: the driver reads its auth mode then

import torch  # noqa: E402

from deployments.models import families  # noqa: E402
from deployments.replica.stage_residency import StageResidency  # noqa: E402
from deployments.wire import media  # noqa: E402
from deployments.wire.spec import GenerationSpec, PipelineStage  # noqa: E402
from offload_core.planner.search import PerformanceMode  # noqa: E402

CONCURRENCY = (1, 2, 4)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def in_process_offloaded(facts, spec: GenerationSpec, mode: PerformanceMode):
    """One request through the three stages under offload_core in this process (a callable)."""
    from cluster.replica.ledger_view import ReplicaMemory

    cpu = torch.device("cpu")
    memory = ReplicaMemory.open_local("bench", cpu)
    stages = {}
    for stage in PipelineStage:
        pipe = families.load_stage_pipeline(facts, stage, torch.float32)
        uses = families.uses_per_request(facts, stage, spec.steps, spec.guidance_scale)
        residency = StageResidency(stage.value, families.stage_modules(pipe, facts, stage), uses, mode, cpu,
                                   device_capacity=memory.device_budget.capacity(),
                                   host_budget=memory.host_budget, owner=f"bench-{stage.value}")
        stages[stage] = (pipe, residency)

    def under(stage, fn):
        pipe, residency = stages[stage]
        residency.prepare_for_use()
        try:
            return fn(pipe)
        finally:
            residency.finish_use()

    def once():
        encoded = under(PipelineStage.ENCODE, lambda p: families.encode(p, facts, spec, cpu))
        latents = under(PipelineStage.DENOISE, lambda p: families.denoise(p, facts, encoded, spec, cpu))
        frames = under(PipelineStage.DECODE, lambda p: families.decode(p, facts, latents, spec, cpu))
        return [media.png_bytes(f[0]) for f in frames]

    return once


def start_service(model_path: str, mode: PerformanceMode):
    from ray import serve

    from deployments.app import AppArgs, StageArgs, build_app
    from deployments.capacity.request_limits import Limits

    local_ray.init_local(include_dashboard=False, object_store_memory=200 * 1024 * 1024, log_to_driver=False)
    port = _free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    stage = StageArgs(offload_mode=mode)
    args = AppArgs(app_name="bench", model_path=model_path, encoder=stage, denoiser=stage, decoder=stage,
                   limits=Limits(max_width=1024, max_height=1024), replica_num_cpus=0.0,
                   stage_max_queued_requests=64)
    started = time.perf_counter()
    serve.run(build_app(args), name="bench", route_prefix="/")
    return f"http://127.0.0.1:{port}", time.perf_counter() - started


def side_by_side(plain, offloaded, client, body: dict, repeats: int) -> tuple[float, float, float]:
    """Median seconds of the in-process pipeline, in-process offloaded and the service, timed in turn."""
    def served():
        response = client.post("/v1/images/generations", json=body)
        assert response.status_code == 200, response.text

    fns = (plain, offloaded, served)
    for fn in fns:  # warm-up: first-call allocations and lazy imports are not the steady state
        fn()
    times = {fn: [] for fn in fns}
    for _ in range(repeats):
        for fn in fns:
            start = time.perf_counter()
            fn()
            times[fn].append(time.perf_counter() - start)
    return tuple(statistics.median(times[fn]) for fn in fns)


def hops(app: str, spec: GenerationSpec, repeats: int) -> dict[str, tuple[float, float]]:
    """Per stage: (median handle wall time from this process, median stage time in the replica)."""
    from ray import serve

    encoder = serve.get_deployment_handle("TextEncoder", app)
    denoiser = serve.get_deployment_handle("Denoiser", app)
    decoder = serve.get_deployment_handle("VaeDecoder", app)
    calls = {
        "encode": lambda: encoder.encode.remote(spec).result(),
        # No progress events, as the service asks for a plain (not streamed) request.
        "denoise": lambda: list(denoiser.options(stream=True).denoise.remote(encoded, spec, False))[-1],
        "decode": lambda: decoder.decode.remote(latents, spec).result(),
    }
    encoded = calls["encode"]()
    latents = calls["denoise"]()
    out = {}
    for stage, call in calls.items():
        walls, inside = [], []
        for _ in range(repeats):
            start = time.perf_counter()
            result = call()
            walls.append(time.perf_counter() - start)
            inside.append(result.stats.seconds)
        out[stage] = (statistics.median(walls), statistics.median(inside))
    return out


def lease_figures(client) -> dict[str, dict]:
    replicas = client.get("/v1/residency").json()["replicas"]
    return {r["stage"]: r.get("leases", {}) for r in replicas}


def throughput(client, body: dict, clients: int, total: int) -> float:
    def one(i: int) -> None:
        response = client.post("/v1/images/generations", json={**body, "seed": i})
        assert response.status_code == 200, response.text

    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        list(pool.map(one, range(total)))
    return total / (time.perf_counter() - start)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny Wan, few repeats (< 60 s)")
    parser.add_argument("--medium", action="store_true", help="the medium Wan (~300 MB denoiser)")
    parser.add_argument("--size", default=None)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--mode", default="auto", choices=[m.value for m in PerformanceMode])
    args = parser.parse_args(argv)

    import httpx
    import ray
    from ray import serve

    from zoo import tiny

    folder = tiny.ensure_medium_wan() if args.medium else tiny.ensure_tiny_wan()
    facts = families.read_family_facts(folder)
    size = args.size or ("32x32" if args.quick else "64x64")
    steps = args.steps or (2 if args.quick else 8)
    # Alternated, so a load that comes and goes weighs on every column alike; 9 keep --quick < 90 s.
    repeats, per_level = (9, 6) if args.quick else (20, 16)
    width, height = (int(v) for v in size.split("x"))
    mode = PerformanceMode(args.mode)
    spec = GenerationSpec("bench", "a lighthouse at dawn", None, height, width, 1, steps, facts.default_guidance, 0, 1)
    body = {"prompt": spec.prompt, "size": size, "num_inference_steps": steps, "seed": 0}

    pipe = families.load_full_pipeline(facts, torch.float32)

    def plain():
        return [media.png_bytes(f[0]) for f in families.reference_frames(pipe, facts, spec)]

    offloaded = in_process_offloaded(facts, spec, mode)
    base, deploy_s = start_service(str(folder), mode)
    try:
        with httpx.Client(base_url=base, timeout=600) as client:
            plain_s, offloaded_s, service_s = side_by_side(plain, offloaded, client, body, repeats)
            per_stage = hops("bench", dataclasses.replace(spec, request_id="hops"), repeats)
            rates = {c: throughput(client, body, c, per_level) for c in CONCURRENCY}
            leases = lease_figures(client)
    finally:
        serve.shutdown()
        ray.shutdown()

    print(f"model {folder.name} ({facts.family.value}), {size}, {steps} steps, offload mode {mode.value}, "
          f"median of {repeats}; service deployed in {deploy_s:.1f} s")
    print(f"{'latency':28s} {'ms':>9s} {'x in-process':>13s}")
    for name, seconds in (("in-process pipeline", plain_s), ("in-process, offloaded", offloaded_s),
                          ("service (HTTP, 3 stages)", service_s)):
        print(f"{name:28s} {seconds * 1e3:9.1f} {seconds / plain_s:13.2f}")
    print(f"service overhead vs in-process: {(service_s - plain_s) * 1e3:.1f} ms "
          f"(of which offload: {(offloaded_s - plain_s) * 1e3:.1f} ms)")
    print(f"{'hop':28s} {'ms':>9s}")
    handles_s = sum(wall for wall, _ in per_stage.values())
    breakdown = {}
    for stage, (wall, inside) in per_stage.items():
        breakdown[f"{stage}_in_replica_ms"] = round(inside * 1e3, 2)
        breakdown[f"{stage}_ray_hop_ms"] = round((wall - inside) * 1e3, 2)
    breakdown["http_ingress_png_ms"] = round((service_s - handles_s) * 1e3, 2)
    for name, ms in breakdown.items():
        print(f"{name.removesuffix('_ms').replace('_', ' '):28s} {ms:9.1f}")
    print("calls without a ledger round trip: " + ", ".join(
        f"{stage} {f.get('calls_without_round_trip', 0)}/{f.get('calls', 0)}" for stage, f in sorted(leases.items())))
    print("throughput, requests/s by concurrent clients: " +
          ", ".join(f"{c}: {rates[c]:.2f}" for c in CONCURRENCY))
    result = {"bench": "serve", "model": folder.name, "size": size, "steps": steps, "mode": mode.value,
              "in_process_ms": round(plain_s * 1e3, 2), "in_process_offloaded_ms": round(offloaded_s * 1e3, 2),
              "service_ms": round(service_s * 1e3, 2), "service_over_in_process": round(service_s / plain_s, 3),
              "overhead_ms": round((service_s - plain_s) * 1e3, 2), "hops_ms": breakdown,
              "calls_without_round_trip": {stage: [f.get("calls_without_round_trip", 0), f.get("calls", 0)]
                                           for stage, f in sorted(leases.items())},
              "throughput_rps": {str(c): round(rates[c], 3) for c in CONCURRENCY},
              "deploy_s": round(deploy_s, 1)}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
