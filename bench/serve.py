"""Latency of the split-stage service vs. the same pipeline in-process, and throughput by concurrency.

    python bench/serve.py --quick      # tiny Wan, < 60 s on 2 CPUs (most of it is deploying)
    python bench/serve.py --medium     # the ~300 MB medium Wan denoiser

Prints a table, then (last line) one JSON object. Three latencies side by side, same request:
- in-process: the plain diffusers pipeline + PNG encoding (the baseline);
- in-process offloaded: the three stages under offload_core in one process (the engine's cost);
- service: POST /v1/images/generations over HTTP through Ray Serve (engine + Ray + HTTP).
"""
from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import pathlib
import socket
import statistics
import sys
import time

for _name, _value in (("RAY_AUTH_MODE", "disabled"), ("RAY_USAGE_STATS_ENABLED", "0"), ("HF_HUB_OFFLINE", "1"),
                      ("TRANSFORMERS_OFFLINE", "1")):
    os.environ.setdefault(_name, _value)
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from deployments import families, media  # noqa: E402
from deployments.offload import StageResidency  # noqa: E402
from deployments.spec import GenerationSpec, PipelineStage  # noqa: E402
from offload_core.planner.search import PerformanceMode  # noqa: E402

CONCURRENCY = (1, 2, 4)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _median_s(fn, repeats: int) -> float:
    fn()  # warm-up: first-call allocations and lazy imports are not the steady state
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def in_process(facts, spec: GenerationSpec, repeats: int) -> float:
    pipe = families.load_full_pipeline(facts, torch.float32)
    return _median_s(lambda: [media.png_bytes(f[0]) for f in families.reference_frames(pipe, facts, spec)], repeats)


def in_process_offloaded(facts, spec: GenerationSpec, mode: PerformanceMode, repeats: int) -> float:
    from cluster.replica_memory import ReplicaMemory

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
        frames = under(PipelineStage.DECODE, lambda p: families.decode(p, facts, latents, spec))
        return [media.png_bytes(f[0]) for f in frames]

    return _median_s(once, repeats)


def start_service(model_path: str, mode: PerformanceMode):
    import ray
    from ray import serve

    from deployments.app import AppArgs, StageArgs, build_app
    from deployments.schemas import Limits

    ray.init(address="local", include_dashboard=False, object_store_memory=200 * 1024 * 1024, log_to_driver=False)
    port = _free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    stage = StageArgs(offload_mode=mode)
    args = AppArgs(app_name="bench", model_path=model_path, encoder=stage, denoiser=stage, decoder=stage,
                   limits=Limits(max_width=1024, max_height=1024), replica_num_cpus=0.0,
                   stage_max_queued_requests=64)
    started = time.perf_counter()
    serve.run(build_app(args), name="bench", route_prefix="/")
    return f"http://127.0.0.1:{port}", time.perf_counter() - started


def service_latency(client, body: dict, repeats: int) -> float:
    def once():
        response = client.post("/v1/images/generations", json=body)
        assert response.status_code == 200, response.text

    return _median_s(once, repeats)


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
    repeats, per_level = (3, 6) if args.quick else (10, 16)
    width, height = (int(v) for v in size.split("x"))
    mode = PerformanceMode(args.mode)
    spec = GenerationSpec("bench", "a lighthouse at dawn", None, height, width, 1, steps, facts.default_guidance, 0, 1)
    body = {"prompt": spec.prompt, "size": size, "num_inference_steps": steps, "seed": 0}

    plain_s = in_process(facts, spec, repeats)
    offloaded_s = in_process_offloaded(facts, spec, mode, repeats)
    base, deploy_s = start_service(str(folder), mode)
    try:
        with httpx.Client(base_url=base, timeout=600) as client:
            service_s = service_latency(client, body, repeats)
            rates = {c: throughput(client, body, c, per_level) for c in CONCURRENCY}
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
    print("throughput, requests/s by concurrent clients: " +
          ", ".join(f"{c}: {rates[c]:.2f}" for c in CONCURRENCY))
    result = {"bench": "serve", "model": folder.name, "size": size, "steps": steps, "mode": mode.value,
              "in_process_ms": round(plain_s * 1e3, 2), "in_process_offloaded_ms": round(offloaded_s * 1e3, 2),
              "service_ms": round(service_s * 1e3, 2), "service_over_in_process": round(service_s / plain_s, 3),
              "overhead_ms": round((service_s - plain_s) * 1e3, 2),
              "throughput_rps": {str(c): round(rates[c], 3) for c in CONCURRENCY},
              "deploy_s": round(deploy_s, 1)}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
