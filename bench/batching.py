"""Step-level batching: bytes streamed per request, throughput and latency at 1, 2, 4, 8 clients.

Then a projection on the simulated accelerator (``bench/batching_projection.py``): FLUX.1-dev's
real structure at 512x512 and 28 steps, images per hour at batch 1, 2, 4, 8, streamed on an RTX
4090 (it does not fit resident in 24 GB) beside resident on an L40S.

The medium Wan denoiser in memory mode (every layer streamed, depth 1) behind one StepBatcher,
as the Denoiser replica runs it; N client threads each send requests back to back. Side by side
in one run. Last line: one JSON object with ``bytes_per_request_ratio_4_vs_1``.

    .venv/bin/python bench/batching.py --quick
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from batching_projection import print_projection, project  # noqa: E402

from deployments.models import families  # noqa: E402
from deployments.models.steppers import stepper_for  # noqa: E402
from deployments.replica.batching import BatchingConfig, StepBatch, StepBatcher  # noqa: E402
from deployments.wire.spec import GenerationSpec, PipelineStage  # noqa: E402
from offload_core import StreamingConfig, apply_layer_streaming  # noqa: E402
from zoo.tiny import ensure_medium_wan  # noqa: E402

CPU = torch.device("cpu")


def run_clients(batcher, stepper, encoded, clients: int, per_client: int, steps: int) -> dict:
    latencies: list[float] = []
    lock = threading.Lock()

    def client(c: int) -> None:
        for i in range(per_client):
            spec = GenerationSpec(f"c{c}-{i}", "a red fox", None, 16, 16, 1, steps, 5.0, c * 100 + i, 1)
            start = time.perf_counter()
            batcher.submit(stepper.start(encoded, spec)).result()
            with lock:
                latencies.append(time.perf_counter() - start)

    threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    latencies.sort()
    return {"requests": len(latencies), "requests_per_s": round(len(latencies) / wall, 3),
            "p50_s": round(statistics.median(latencies), 4),
            "p99_s": round(latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))], 4)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 requests per client, 4 steps")
    args = parser.parse_args()
    per_client, steps = (3, 4) if args.quick else (6, 8)
    torch.set_num_threads(1)
    facts = families.read_family_traits(ensure_medium_wan())
    encoder = families.load_stage_pipeline(facts, PipelineStage.ENCODE, torch.float32)
    pipe = families.load_stage_pipeline(facts, PipelineStage.DENOISE, torch.float32)
    encoded = families.encode(encoder, facts, GenerationSpec("e", "a red fox", None, 16, 16, 1, steps, 5.0, 0, 1), CPU)
    streamer = apply_layer_streaming(pipe.transformer, CPU, StreamingConfig(prefetch_depth=1))
    stepper = stepper_for(pipe, facts, CPU)
    rows = []
    try:
        for clients in (1, 2, 4, 8):
            batch = StepBatch(stepper, BatchingConfig(max_batch=8))
            batcher = StepBatcher(batch)
            before = streamer.bytes_copied
            row = run_clients(batcher, stepper, encoded, clients, per_client, steps)
            batcher.close()
            row.update(clients=clients, bytes_streamed_per_request=(streamer.bytes_copied - before) // row["requests"],
                       forwards=batch.forwards, mean_batch=round(batch.mean_batch, 2))
            rows.append(row)
    finally:
        streamer.remove()
    base = rows[0]["bytes_streamed_per_request"]
    print(f"medium Wan denoiser, memory mode (all {len(streamer.layers)} layers streamed, depth 1), "
          f"{steps} steps, guidance on, {per_client} requests per client")
    print(f"{'clients':>7} {'bytes/request':>14} {'vs 1':>6} {'req/s':>7} {'p50 s':>7} {'p99 s':>7} {'mean batch':>10}")
    for r in rows:
        print(f"{r['clients']:>7} {r['bytes_streamed_per_request']:>14,} {r['bytes_streamed_per_request'] / base:>6.3f} "
              f"{r['requests_per_s']:>7.2f} {r['p50_s']:>7.3f} {r['p99_s']:>7.3f} {r['mean_batch']:>10.2f}")
    by = {r["clients"]: r for r in rows}
    projection = project()
    print_projection(projection)
    print(json.dumps({"bench": "batching", "rows": rows, "projection": projection,
                      "bytes_per_request_ratio_4_vs_1": round(by[4]["bytes_streamed_per_request"] / base, 4)}))


if __name__ == "__main__":
    main()
