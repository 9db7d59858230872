"""N replicas start at once against one node ledger: does it over-commit, and how fast does it grant?

Each replica (a Ray actor on the node) asks for host RAM in chunks until the node's spendable is
asked for twice over, all replicas at the same moment after a barrier. Printed: the most ever
leased over the spendable (must stay <= 1.0), granted/refused counts, and grant latency
(one ``request`` round trip from the replica, p50/p99). Then the same replicas share one fake
"12 GB" GPU (the node advertises accelerator_type:RTX3060) and run stage calls whose 4 GB
working sets fit two at a time: the most ever leased over the GPU pool (<= 1.0) and the time a
call waited for its working set. Last, three real stage replicas of the tiny Wan share one small GPU
(bench/shared_gpu.py): the peak of their standing + call leases, and the peak of what they held
(weights and activations), over the GPU's pool, both <= 1.0. The last line is one JSON object.

    .venv/bin/python bench/ledger.py --quick      # 8 replicas x 16 requests, < 60 s
    .venv/bin/python bench/ledger.py              # 24 replicas x 40 requests
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

from deployments.dev import local_ray  # noqa: E402

local_ray.use_token_auth()  # before Ray is imported: the driver reads its auth mode then

import ray  # noqa: E402

from cluster.ledger.actor import HOST_POOL, LedgerConfig, node_ledger  # noqa: E402
from cluster.replica.ledger_client import LedgerClient  # noqa: E402
from offload_core.host.budget import Lease  # noqa: E402

# Every replica may take the whole pool: the pool's limit, not the per-replica cap, is under test.
CONFIG = LedgerConfig(owner_cap_fraction=1.0)


@ray.remote(num_cpus=0)
class Replica:
    def __init__(self, name: str):
        self.client = LedgerClient(node_ledger(config=CONFIG), name, CONFIG)

    def ready(self) -> bool:
        return True

    def run(self, chunk: int, count: int, start_at: float) -> tuple[list[float], int, int]:
        time.sleep(max(0.0, start_at - time.time()))  # all replicas fire at the same moment
        latencies, granted, refused = [], 0, 0
        for _ in range(count):
            t0 = time.perf_counter()
            got = self.client.request(HOST_POOL, chunk, self.client.ref.owner, float(chunk), "bench")
            latencies.append(time.perf_counter() - t0)
            granted, refused = granted + isinstance(got, Lease), refused + (not isinstance(got, Lease))
        return latencies, granted, refused

    def stage_calls(self, nbytes: int, count: int, hold_s: float, start_at: float) -> list[float]:
        """Stage calls that lease a working set on the shared GPU: seconds each waited for it."""
        pool = f"gpu:{int(ray.get_gpu_ids()[0])}"
        time.sleep(max(0.0, start_at - time.time()))
        waits = []
        for _ in range(count):
            t0 = time.perf_counter()
            got = self.client.request(pool, nbytes, self.client.ref.owner, 1.0, "working-set", wait_s=60.0)
            waits.append(time.perf_counter() - t0)
            assert isinstance(got, Lease), f"a 60 s wait for {nbytes} B should always be served: {got}"
            time.sleep(hold_s)
            self.client.release(pool, got)
        return waits

    def close(self) -> int:
        return self.client.close()


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="8 replicas x 16 requests (< 60 s)")
    parser.add_argument("--replicas", type=int)
    parser.add_argument("--requests", type=int, help="requests per replica")
    args = parser.parse_args()
    replicas = args.replicas or (8 if args.quick else 24)
    requests = args.requests or (16 if args.quick else 40)

    # One fake 12 GB GPU (cluster/node.py sizes it from the gpus table when NVML sees none).
    # address="local": a cluster of its own, never one another process on this machine started.
    local_ray.init_local(num_cpus=2, num_gpus=1, resources={"accelerator_type:RTX3060": 1}, include_dashboard=False,
             object_store_memory=100 * 2**20, log_to_driver=False, namespace="offload-serve-bench")
    try:
        ledger = node_ledger(config=CONFIG)
        spendable = ray.get(ledger.state.remote()).pool(HOST_POOL).capacity
        # Demand = 2x spendable in total, so the pool runs full and the refusal path is exercised.
        chunk = max(1, 2 * spendable // (replicas * requests))
        actors = [Replica.options(num_gpus=1 / replicas).remote(f"bench-{i}") for i in range(replicas)]
        t0 = time.perf_counter()
        ray.get([a.ready.remote() for a in actors])
        startup_s = time.perf_counter() - t0
        results = ray.get([a.run.remote(chunk, requests, time.time() + 1.0) for a in actors])
        state = ray.get(ledger.state.remote()).pool(HOST_POOL)
        ray.get([a.close.remote() for a in actors])
        left = ray.get(ledger.state.remote()).pool(HOST_POOL).leased
        gpu_capacity = ray.get(ledger.state.remote()).pool("gpu:0").capacity
        working_set = int(gpu_capacity * 0.36)  # two fit, three never (2 x 0.36 < 1 < 3 x 0.36)
        calls = max(2, requests // 4)
        waits = [w for ws in ray.get([a.stage_calls.remote(working_set, calls, 0.01, time.time() + 1.0)
                                      for a in actors]) for w in ws]
        gpu = ray.get(ledger.state.remote()).pool("gpu:0")
    finally:
        ray.shutdown()
    from bench import shared_gpu

    shared = shared_gpu.run(calls=8 if args.quick else 24)

    latencies = [x for lat, _, _ in results for x in lat]
    granted, refused = sum(r[1] for r in results), sum(r[2] for r in results)
    figures = {
        "replicas": replicas, "requests_per_replica": requests, "chunk_bytes": chunk,
        "spendable_bytes": spendable, "peak_leased_bytes": state.peak_leased,
        "peak_over_spendable": round(state.peak_leased / spendable, 4),
        "granted": granted, "refused": refused, "leased_after_close_bytes": left,
        "grant_latency_p50_ms": round(1e3 * statistics.median(latencies), 3),
        "grant_latency_p99_ms": round(1e3 * percentile(latencies, 0.99), 3),
        "replica_startup_s": round(startup_s, 2),
        "gpu_pool_bytes": gpu_capacity, "working_set_bytes": working_set, "stage_calls": len(waits),
        "gpu_peak_over_capacity": round(gpu.peak_leased / gpu_capacity, 4),
        "working_set_wait_p50_ms": round(1e3 * statistics.median(waits), 3),
        "working_set_wait_p99_ms": round(1e3 * percentile(waits, 0.99), 3),
        "gpu_leased_after_calls_bytes": gpu.leased,
    }
    print(f"{replicas} replicas x {requests} requests of {chunk / 2**20:.1f} MiB against "
          f"{spendable / 2**30:.2f} GiB spendable (started in {startup_s:.1f} s)")
    print(f"peak leased / spendable: {figures['peak_over_spendable']:.4f} (must be <= 1.0); "
          f"granted {granted}, refused {refused}; left after close: {left} B")
    print(f"grant latency: p50 {figures['grant_latency_p50_ms']:.2f} ms, p99 {figures['grant_latency_p99_ms']:.2f} ms")
    print(f"shared {gpu_capacity / 1e9:.2f} GB GPU pool, {len(waits)} stage calls of {working_set / 1e9:.2f} GB: "
          f"peak leased / pool {figures['gpu_peak_over_capacity']:.4f} (must be <= 1.0); working-set wait "
          f"p50 {figures['working_set_wait_p50_ms']:.2f} ms, p99 {figures['working_set_wait_p99_ms']:.2f} ms")
    figures.update(shared)
    print(f"shared GPU: 3 tiny-Wan stage replicas, {shared['shared_gpu_calls']} calls of mixed shapes on a "
          f"{shared['shared_gpu_pool_bytes'] / 1e6:.0f} MB pool: lease peak / pool "
          f"{shared['shared_gpu_lease_peak_over_capacity']:.4f}, held peak / pool "
          f"{shared['shared_gpu_held_peak_over_capacity']:.4f} (both must be <= 1.0); calls holding more than "
          f"they leased: {shared['shared_gpu_calls_holding_more_than_leased']}")
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
