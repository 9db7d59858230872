"""Routing on a mixed fleet: Serve's default router and ours side by side on one seeded trace.

A local Ray cluster with two nodes of simulated GPU types (SIM1X, SIM3X: step time 1x and 3x); two
apps of 4 stand-in Denoisers each (testing/sim_denoiser.py: the service's step batcher, load tracker
and routing stats; the forward sleeps its simulated cost, with seeded +-20 % jitter per step and a
cost growing with the shape), 2 replicas per type each: one app on Serve's default router (power of
two choices), one on ours (deployments/routing: earliest predicted finish). One seeded Poisson trace of
mixed requests (512x512 images at 4 and 28 steps, 320x192x9 videos at 20 steps) is played against
each, at 70 % and 90 % of the fleet's capacity (unbatched: sum over replicas of 1 / mean request time).

Latency is from the request's arrival to its result; throughput is requests / (last result - first
arrival). Prediction error is |predicted - actual| / actual over our router's requests (actual: from
routing to the result, as the router measures it).

    PYTHONPATH=. .venv/bin/python bench/mixed_fleet.py --quick     # < 3 min on the 2-core VM

Prints figures, then one JSON object; exits 1 on a missed target (bench/checks.py).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import date
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import checks  # noqa: E402
from tests import conftest as test_cluster  # noqa: E402  (sets the tests' Ray environment first)

# (weight, width, height, frames, steps): images at 4 and 28 steps, short videos.
MIX = ((0.4, 512, 512, 1, 4), (0.4, 512, 512, 1, 28), (0.2, 320, 192, 9, 20))
LOADS = (0.7, 0.9)
STATS_PERIOD_S = 1.0  # the app default; well above the controller loop (0.25 s in the tests cluster)
APPS = {"default": "mixed-default", "predicted": "mixed-predicted"}
RESOURCES = {"default": "sim_gpu_default", "predicted": "sim_gpu_predicted"}


@dataclass(frozen=True)
class Arrival:
    at_s: float
    width: int
    height: int
    frames: int
    steps: int


def trace(n: int, rate: float, seed: int) -> list[Arrival]:
    rng, t, out = random.Random(seed), 0.0, []
    weights = [m[0] for m in MIX]
    for _ in range(n):
        t += rng.expovariate(rate)
        _, w, h, f, s = rng.choices(MIX, weights)[0]
        out.append(Arrival(t, w, h, f, s))
    return out


def capacity_rps(cost) -> float:
    """Requests per second the fleet serves without batching: sum over replicas of 1 / mean request time."""
    from deployments.capacity.replica_load import Shape

    mean_fast = sum(wt * s * cost.step_s(Shape(w, h, f), 1, 1.0) for wt, w, h, f, s in MIX) / sum(m[0] for m in MIX)
    return sum(2 / (mean_fast * speed) for _, speed in cost.speeds)


async def play(handle, arrivals: list[Arrival], tag: str) -> dict:
    from deployments.wire.spec import GenerationSpec

    async def one(i: int, a: Arrival, start: float) -> tuple[float, float, str]:
        await asyncio.sleep(max(0.0, start + a.at_s - time.perf_counter()))
        spec = GenerationSpec(f"{tag}-{i}", "p", None, a.height, a.width, a.frames, a.steps, 5.0, i, 1)
        arrived = time.perf_counter()
        result = await handle.denoise.remote(None, spec)
        return arrived, time.perf_counter(), result.gpu_type

    start = time.perf_counter()
    done = await asyncio.gather(*(one(i, a, start) for i, a in enumerate(arrivals)))
    latencies = sorted(end - arrived for arrived, end, _ in done)
    makespan = max(end for _, end, _ in done) - min(arrived for arrived, _, _ in done)
    by_type = {t: sum(1 for *_, g in done if g == t) for t in sorted({g for *_, g in done})}
    return {"p50_s": percentile(latencies, 0.5), "p99_s": percentile(latencies, 0.99),
            "throughput_rps": len(done) / makespan, "by_type": by_type}


def percentile(sorted_values: list[float], q: float) -> float:
    return sorted_values[min(len(sorted_values) - 1, int(round(q * (len(sorted_values) - 1))))]


async def warm(handles: dict, n: int, seed: int) -> None:
    """Every replica runs every shape a few times first (both apps alike), so the routed traces start
    from measured step times, as a fleet that has served for a while does."""
    warm_trace = [Arrival(0.0, w, h, f, 2) for _, w, h, f, _ in MIX] * n
    for name, handle in handles.items():
        await play(handle, warm_trace, f"warm-{name}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="100 requests per trace (< 3 min)")
    parser.add_argument("--requests", type=int, default=None, help="requests per trace (default 400; 100 quick)")
    parser.add_argument("--seed", type=int, default=37)
    parser.add_argument("--save", type=Path, default=None, help="write the result file here (bench/results/...)")
    args = parser.parse_args()
    n = args.requests or (100 if args.quick else 400)

    from ray import serve

    from deployments.routing import outcomes as routing
    from deployments.routing.config import RoutingMode
    from testing.sim_denoiser import SimCost
    from testing.sim_fleet import add_sim_nodes, sim_app

    cost = SimCost(seed=args.seed)
    capacity = capacity_rps(cost)
    print(f"fleet: 2 x SIM1X + 2 x SIM3X per app; capacity {capacity:.2f} requests/s unbatched; "
          f"{n} requests per trace, stats every {STATS_PERIOD_S} s", flush=True)
    results: dict[str, dict[float, dict]] = {"default": {}, "predicted": {}}
    t0 = time.perf_counter()
    with test_cluster.local_cluster() as cluster:
        add_sim_nodes(cluster, {name: 2 for name, _ in cost.speeds}, tuple(RESOURCES.values()))
        handles = {}
        for name, mode in (("default", RoutingMode.DEFAULT), ("predicted", RoutingMode.PREDICTED)):
            app = sim_app(cost, mode, 4, STATS_PERIOD_S, resource=RESOURCES[name])
            handles[name] = serve.run(app, name=APPS[name], route_prefix=None)
        print(f"deployed both apps in {time.perf_counter() - t0:.1f} s", flush=True)
        asyncio.run(warm(handles, 3, args.seed))
        time.sleep(2 * STATS_PERIOD_S)  # the warm-up's timings reach the router
        routing.OUTCOMES.clear()
        for load in LOADS:
            arrivals = trace(n, load * capacity, args.seed + int(load * 100))
            for name, handle in handles.items():
                results[name][load] = asyncio.run(play(handle, arrivals, f"{name}-{load}"))
                r = results[name][load]
                print(f"load {load:.0%} {name:>9}: p50 {r['p50_s']:.3f} s, p99 {r['p99_s']:.3f} s, "
                      f"{r['throughput_rps']:.2f} requests/s; by type {r['by_type']}", flush=True)
                time.sleep(2 * STATS_PERIOD_S)
        outcomes = [o for o in routing.OUTCOMES if o.predicted_s is not None and o.actual_s > 0]
        errors = sorted(abs(o.predicted_s - o.actual_s) / o.actual_s for o in outcomes)
        rules = {rule: sum(1 for o in routing.OUTCOMES if o.rule == rule) for rule in {o.rule for o in routing.OUTCOMES}}
    d, p = results["default"], results["predicted"]
    result = {
        "p50_ratio_70": round(p[0.7]["p50_s"] / d[0.7]["p50_s"], 3),
        "p99_ratio_70": round(p[0.7]["p99_s"] / d[0.7]["p99_s"], 3),
        "p99_ratio_90": round(p[0.9]["p99_s"] / d[0.9]["p99_s"], 3),
        "throughput_ratio_90": round(p[0.9]["throughput_rps"] / d[0.9]["throughput_rps"], 3),
        "prediction_error_p50": round(percentile(errors, 0.5), 3) if errors else None,
        "prediction_error_p90": round(percentile(errors, 0.9), 3) if errors else None,
        "routed_by_rule": rules, "requests_per_trace": n, "capacity_rps": round(capacity, 3),
        "runs": {name: {f"{int(load * 100)}": {k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()}
                        for load, r in runs.items()} for name, runs in results.items()},
        "seconds": round(time.perf_counter() - t0, 1),
    }
    print(f"ours / default: p50 at 70 % {result['p50_ratio_70']}, p99 at 70 % {result['p99_ratio_70']}, "
          f"p99 at 90 % {result['p99_ratio_90']}, throughput at 90 % {result['throughput_ratio_90']}; "
          f"prediction error median {result['prediction_error_p50']} (p90 {result['prediction_error_p90']}) "
          f"over {len(errors)} requests; {result['seconds']} s", flush=True)
    verdict = [checks.at_most("p99_ratio_70", result["p99_ratio_70"], 0.7),
               checks.at_least("throughput_ratio_90", result["throughput_ratio_90"], 1.0),
               checks.at_most("prediction_error_p50", result["prediction_error_p50"] if errors else float("inf"), 0.15)]
    if args.save is not None:
        save(args.save, result, verdict, " ".join(["PYTHONPATH=. .venv/bin/python bench/mixed_fleet.py", *sys.argv[1:]]))
    return checks.finish(result, verdict)


def save(path: Path, result: dict, verdict: list, command: str) -> None:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout
    missed = [c.name for c in verdict if c.missed]
    figures = [
        {"name": "p99 latency at 70 % load, ours / Serve's default router", "value": result["p99_ratio_70"], "target": "<= 0.7",
         "headline": "Mixed GPU fleet (1x + 3x step time): p99 latency at 70 % load, predicted-finish routing "
                     "vs Serve's default", "headline_value": f"{result['p99_ratio_70']}x"},
        {"name": "p50 latency at 70 % load, ours / default", "value": result["p50_ratio_70"]},
        {"name": "p99 latency at 90 % load, ours / default", "value": result["p99_ratio_90"]},
        {"name": "throughput at 90 % load, ours / default", "value": result["throughput_ratio_90"], "target": ">= 1.0"},
        {"name": "median prediction error |predicted - actual| / actual", "value": result["prediction_error_p50"],
         "target": "<= 0.15"},
        {"name": "p90 prediction error", "value": result["prediction_error_p90"]},
    ]
    runs = result["runs"]
    rows = [[name, load, r["p50_s"], r["p99_s"], r["throughput_rps"], json.dumps(r["by_type"])]
            for name, by_load in runs.items() for load, r in by_load.items()]
    record = {"topic": "Service", "title": "Mixed GPU fleet: routing by predicted finish time", "command": command,
              "machine": "2-core CPU VM (shared)", "commit": commit.strip() or "unknown", "date": str(date.today()),
              "figures": figures,
              "tables": [{"columns": ["router", "load %", "p50 s", "p99 s", "requests/s", "requests by GPU type"],
                          "rows": rows}],
              "notes": [f"{result['requests_per_trace']} requests per trace, capacity {result['capacity_rps']} "
                        "requests/s unbatched; step cost simulated (sleep), so the figures measure routing, not CPU.",
                        f"routed by rule: {json.dumps(result['routed_by_rule'])}; targets missed: {missed or 'none'}."]}
    path.write_text(json.dumps(record, indent=1) + "\n")
    print(f"saved {path}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
