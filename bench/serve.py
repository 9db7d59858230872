"""Latency of the split-stage service vs. the same pipeline in-process, and throughput by concurrency.

    python bench/serve.py --quick      # tiny Wan, ~3 min on 2 CPUs (one of them deploying)
    python bench/serve.py --medium     # the ~300 MB medium Wan denoiser

Prints a table, then (last line) one JSON object. Four latencies side by side, same request:
- in-process: the plain diffusers pipeline + PNG encoding (the baseline);
- in-process offloaded: the three stages under offload_core in one process (the engine's cost);
- service: POST /v1/images/generations over HTTP through Ray Serve (engine + Ray + HTTP);
- floor: Ray Serve's own path for the same request with stages that do nothing
  (bench/serve_floor.py's chain, deployed beside the service on the same HTTP proxy, handing on
  payloads of the service's sizes): what no change in this project's code can remove.
All four are timed in turn, request by request (medians of at least 30 each), so a load that comes
and goes on a shared machine weighs on every column alike. The figure the project owns:
``overhead_over_floor_ms`` = (service - in-process) - floor.

Then where it goes, per hop, from the same timed requests: every stage call says when it started
in its replica (wall clock) and how long it ran, the service's (``stages`` in the response) and the
floor's alike, so each request splits into in (HTTP, proxy, ingress, up to the encoder's call),
the encoder's call, encoder -> denoiser, the denoiser's call, denoiser -> decoder, the decoder's
call, and out (the decoder's answer to the ingress, PNG, JSON, HTTP). Over the floor: each hop's
service median minus the floor's (out also minus the PNG encoding the in-process column pays too),
each stage's replica median minus the same stage in process, and the offload engine in process;
what medians do not add up to is left as ``median_arithmetic``. The replicas' lease figures say
how many calls went without a ledger round trip.
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

# Every column at the same CPU priority and intra-op threads. Ray starts its workers (the Serve
# proxy, the replicas) at its worker_niceness of 15 above the raylet's, which runs at this driver's, so
# under `nice -n 5` the service would run at 19 against the in-process columns' 5 and look slower than it
# is. 0 puts Ray's workers at this process's niceness. Ray gives an actor
# of num_cpus 0 (the bench's replicas) one OpenMP thread; the in-process columns get the same.
for _name, _value in (("RAY_USAGE_STATS_ENABLED", "0"), ("HF_HUB_OFFLINE", "1"),
                      ("TRANSFORMERS_OFFLINE", "1"), ("RAY_worker_niceness", "0"), ("OMP_NUM_THREADS", "1")):
    os.environ.setdefault(_name, _value)
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from bench.serve_hops import timeline, where_it_goes  # noqa: E402
from deployments.dev import local_ray  # noqa: E402

local_ray.use_token_auth()  # before Ray is imported: the driver reads its auth mode then

import torch  # noqa: E402

from deployments.models import families  # noqa: E402
from deployments.replica.stage_residency import StageResidency  # noqa: E402
from deployments.wire import media  # noqa: E402
from deployments.wire.spec import GenerationSpec, PipelineStage  # noqa: E402
from offload_core.planner.search import PerformanceMode  # noqa: E402

CONCURRENCY = (1, 2, 4)
# The floor's app, deployed beside the service on the same HTTP proxy.
FLOOR_APP, FLOOR_PREFIX = "floor", "/floor"
# Medians of at least this many requests per column (the bar for the overhead figure).
MIN_REPEATS = 30


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _nbytes(value) -> int:
    """Bytes of every tensor in ``value`` (a stage's output: tensors, dataclasses, tuples, dicts)."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return sum(_nbytes(getattr(value, f.name)) for f in dataclasses.fields(value))
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(v) for v in value)
    if isinstance(value, dict):
        return sum(_nbytes(v) for v in value.values())
    return 0


def in_process_offloaded(facts, spec: GenerationSpec, mode: PerformanceMode):
    """One request through the three stages under offload_core in this process (a callable), and the
    bytes each stage hands on (encoded prompt, latents, frames): the floor's payloads."""
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

    payloads, stage_s = [], {stage.value: [] for stage in PipelineStage}

    def timed(stage, fn):
        start = time.perf_counter()
        out = under(stage, fn)
        stage_s[stage.value].append(time.perf_counter() - start)
        return out

    def once():
        encoded = timed(PipelineStage.ENCODE, lambda p: families.encode(p, facts, spec, cpu))
        latents = timed(PipelineStage.DENOISE, lambda p: families.denoise(p, facts, encoded, spec, cpu))
        frames = timed(PipelineStage.DECODE, lambda p: families.decode(p, facts, latents, spec, cpu))
        # What the service hands on: the encoder replica sends its embeddings packed (no zero padding).
        payloads[:] = [_nbytes(encoded.packed()), _nbytes(latents), _nbytes(frames)]
        start = time.perf_counter()
        images = [media.png_bytes(f[0]) for f in frames]
        stage_s.setdefault("png", []).append(time.perf_counter() - start)  # the service's ingress does it too
        return images

    once()
    once.stage_s = stage_s  # seconds per stage call (and PNG), in process: what each replica's own time is compared with
    return once, tuple(payloads)


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


def side_by_side(plain, offloaded, client, body: dict, repeats: int
                 ) -> tuple[tuple[float, ...], dict[str, float], dict[str, float]]:
    """Median seconds of the in-process pipeline, in-process offloaded, the service and the floor, timed in
    turn; and the median of each hop and stage of those same requests, the service's and the floor's."""
    parts: dict[str, dict[str, list[float]]] = {"service": {}, "floor": {}}

    def post(column: str, path: str, json: dict) -> None:
        sent_at = time.time()
        response = client.post(path, json=json)
        received_at = time.time()
        assert response.status_code == 200, response.text
        for name, seconds in timeline(sent_at, received_at, response.json()["stages"]).items():
            parts[column].setdefault(name, []).append(seconds)

    def served():
        post("service", "/v1/images/generations", body)

    def floor():
        post("floor", f"{FLOOR_PREFIX}/generate", {"prompt": body["prompt"]})

    fns = (plain, offloaded, served, floor)
    for fn in fns:  # warm-up: first-call allocations and lazy imports are not the steady state
        fn()
    times = {fn: [] for fn in fns}
    for column in parts.values():
        column.clear()
    for _ in range(repeats):
        for fn in fns:
            start = time.perf_counter()
            fn()
            times[fn].append(time.perf_counter() - start)
    medians = ({k: statistics.median(v) for k, v in column.items()} for column in parts.values())
    return tuple(statistics.median(times[fn]) for fn in fns), *medians


def lease_figures(client) -> tuple[dict[str, dict], dict[str, str]]:
    """Per stage: the replica's lease figures, and the first line of its plan (what it streams)."""
    replicas = client.get("/v1/residency").json()["replicas"]
    return {r["stage"]: r.get("leases", {}) for r in replicas}, {r["stage"]: r["plan"][0] for r in replicas}


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
    parser.add_argument("--repeats", type=int, default=MIN_REPEATS, help=f"requests per column (at least {MIN_REPEATS})")
    args = parser.parse_args(argv)

    import httpx
    import ray
    from ray import serve

    from zoo import tiny

    folder = tiny.ensure_medium_wan() if args.medium else tiny.ensure_tiny_wan()
    facts = families.read_family_traits(folder)
    size = args.size or ("32x32" if args.quick else "64x64")
    steps = args.steps or (2 if args.quick else 8)
    # Alternated, so a load that comes and goes weighs on every column alike.
    repeats, per_level = max(args.repeats, MIN_REPEATS), (6 if args.quick else 16)
    width, height = (int(v) for v in size.split("x"))
    mode = PerformanceMode(args.mode)
    spec = GenerationSpec("bench", "a lighthouse at dawn", None, height, width, 1, steps, facts.default_guidance, 0, 1)
    body = {"prompt": spec.prompt, "size": size, "num_inference_steps": steps, "seed": 0}

    pipe = families.load_full_pipeline(facts, torch.float32)

    def plain():
        return [media.png_bytes(f[0]) for f in families.reference_frames(pipe, facts, spec)]

    offloaded, payloads = in_process_offloaded(facts, spec, mode)
    base, deploy_s = start_service(str(folder), mode)
    try:
        from ray import cloudpickle

        from bench import serve_floor

        cloudpickle.register_pickle_by_value(serve_floor)  # the replicas need not import bench/
        serve.run(serve_floor.floor_app(payloads), name=FLOOR_APP, route_prefix=FLOOR_PREFIX)
        with httpx.Client(base_url=base, timeout=600) as client:
            (plain_s, offloaded_s, service_s, floor_s), service_parts, floor_parts = side_by_side(
                plain, offloaded, client, body, repeats)
            rates = {c: throughput(client, body, c, per_level) for c in CONCURRENCY}
            leases, plans = lease_figures(client)
    finally:
        serve.shutdown()
        ray.shutdown()

    print(f"model {folder.name} ({facts.family.value}), {size}, {steps} steps, offload mode {mode.value}, "
          f"median of {repeats}; service deployed in {deploy_s:.1f} s")
    print(f"{'latency':28s} {'ms':>9s} {'x in-process':>13s}")
    for name, seconds in (("in-process pipeline", plain_s), ("in-process, offloaded", offloaded_s),
                          ("service (HTTP, 3 stages)", service_s)):
        print(f"{name:28s} {seconds * 1e3:9.1f} {seconds / plain_s:13.2f}")
    over_floor = (service_s - plain_s) - floor_s
    print(f"{'floor (Ray Serve, no-op stages)':28s} {floor_s * 1e3:9.1f}")
    print(f"service overhead vs in-process: {(service_s - plain_s) * 1e3:.1f} ms "
          f"(of which offload: {(offloaded_s - plain_s) * 1e3:.1f} ms); Ray Serve's floor {floor_s * 1e3:.1f} ms; "
          f"over the floor: {over_floor * 1e3:.1f} ms (payloads {payloads[0]}, {payloads[1]}, {payloads[2]} B)")
    in_process_s = {name: statistics.median(values[-repeats:]) for name, values in offloaded.stage_s.items()}
    hops_ms, over = where_it_goes(service_parts, floor_parts, in_process_s, offloaded_s - plain_s, over_floor)
    print(f"{'per request (medians)':28s} {'service ms':>10s} {'floor ms':>9s} {'in process ms':>14s} {'over ms':>8s}")
    for name, row in hops_ms.items():
        print(f"{name.replace('_', ' '):28s} {row['service']:10.2f} {row['floor']:9.2f} "
              f"{row.get('in_process', float('nan')):14.2f} {over[name]:8.2f}")
    print("over the floor: " + ", ".join(f"{name.replace('_', ' ')} {ms:.1f} ms" for name, ms in over.items()))
    for stage, plan in sorted(plans.items()):
        print(f"{stage} plan: {plan}")
    print("calls without a ledger round trip: " + ", ".join(
        f"{stage} {f.get('calls_without_round_trip', 0)}/{f.get('calls', 0)}" for stage, f in sorted(leases.items())))
    print("throughput, requests/s by concurrent clients: " +
          ", ".join(f"{c}: {rates[c]:.2f}" for c in CONCURRENCY))
    result = {"bench": "serve", "model": folder.name, "size": size, "steps": steps, "mode": mode.value,
              "in_process_ms": round(plain_s * 1e3, 2), "in_process_offloaded_ms": round(offloaded_s * 1e3, 2),
              "service_ms": round(service_s * 1e3, 2), "service_over_in_process": round(service_s / plain_s, 3),
              "overhead_ms": round((service_s - plain_s) * 1e3, 2), "floor_ms": round(floor_s * 1e3, 2),
              "overhead_over_floor_ms": round(over_floor * 1e3, 2), "over_floor_ms": over,
              "payload_bytes": list(payloads), "repeats": repeats, "load_average": round(os.getloadavg()[0], 2),
              "niceness": os.getpriority(os.PRIO_PROCESS, 0),
              "ray_worker_niceness": int(os.environ["RAY_worker_niceness"]),
              "omp_num_threads": int(os.environ["OMP_NUM_THREADS"]),
              "hops_ms": hops_ms, "png_in_process_ms": round(in_process_s["png"] * 1e3, 2),
              "calls_without_round_trip": {stage: [f.get("calls_without_round_trip", 0), f.get("calls", 0)]
                                           for stage, f in sorted(leases.items())},
              "throughput_rps": {str(c): round(rates[c], 3) for c in CONCURRENCY},
              "deploy_s": round(deploy_s, 1)}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
