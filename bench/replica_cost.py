"""What a stage call costs around the stage's own work: the tiny Wan's encoder bare, under the
stage worker (leases, residency, admission, records), and in a plain Ray actor, interleaved.

    python bench/replica_cost.py           # 20 calls each (~1 min on 2 CPUs)

bench/serve.py finds the service's replicas slower than the same code in process; this separates
the worker's code (in this process) and Ray's worker process (a plain actor, no Serve) from what
is left to the Serve replica itself. Prints a table, then (last line) one JSON object.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import sys
import time

# Ray's workers at this process's niceness (its default puts them 15 above: bench/serve.py says why).
for _name, _value in (("RAY_USAGE_STATS_ENABLED", "0"), ("HF_HUB_OFFLINE", "1"), ("TRANSFORMERS_OFFLINE", "1"),
                      ("RAY_worker_niceness", "0")):
    os.environ.setdefault(_name, _value)
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from deployments.dev import local_ray  # noqa: E402

local_ray.use_token_auth()  # before Ray is imported: the driver reads its auth mode then

import ray  # noqa: E402
import torch  # noqa: E402

from deployments.models import families  # noqa: E402
from deployments.wire.spec import GenerationSpec, PipelineStage  # noqa: E402

CPU = torch.device("cpu")


@ray.remote(num_cpus=0)
class PlainEncoder:
    """The encoder alone in a Ray worker process: no Serve, no worker."""

    def __init__(self, folder: str, spec: GenerationSpec):
        self.facts = families.read_family_traits(folder)
        self.pipe = families.load_stage_pipeline(self.facts, PipelineStage.ENCODE, torch.float32)
        self.spec = spec

    def encode(self) -> float:
        start = time.perf_counter()
        families.encode(self.pipe, self.facts, self.spec, CPU)
        return time.perf_counter() - start


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=20, help="per column, after one warm-up call each")
    args = parser.parse_args(argv)

    from deployments.app import stage_configs
    from deployments.replica.worker import StageWorker
    from tests.deployments.conftest import tiny_args
    from zoo import tiny

    folder = tiny.ensure_tiny_wan()
    facts = families.read_family_traits(folder)
    spec = GenerationSpec("bench", "a lighthouse at dawn", None, 32, 32, 1, 2, facts.default_guidance, 0, 1)
    worker = StageWorker(stage_configs(tiny_args(), facts)[PipelineStage.ENCODE])
    bare = lambda: families.encode(worker.pipe, facts, spec, CPU)  # noqa: E731
    local_ray.init_local(include_dashboard=False, object_store_memory=100 * 1024 * 1024, log_to_driver=False)
    try:
        actor = PlainEncoder.remote(str(folder), spec)
        columns = {"bare": [], "worker": [], "noop_worker": [], "actor": [], "report": []}
        calls = {"bare": bare, "worker": lambda: worker.run(bare, spec), "noop_worker": lambda: worker.run(lambda: None),
                 "actor": lambda: ray.get(actor.encode.remote()),
                 # What a replica builds for the board once a second after a call, under its call lock.
                 "report": worker.report}
        for name, call in calls.items():  # warm-up
            call()
        for _ in range(args.calls):
            for name, call in calls.items():
                start = time.perf_counter()
                inside = call()
                columns[name].append(inside if name == "actor" else time.perf_counter() - start)
    finally:
        ray.shutdown()
        worker.close()
    load = os.getloadavg()[0]
    medians = {name: statistics.median(values) * 1e3 for name, values in columns.items()}
    print(f"tiny Wan encoder, 32x32, medians of {args.calls} interleaved calls, load average {load:.2f}")
    labels = {"bare": "bare, in this process", "worker": "under StageWorker.run", "noop_worker":
              "StageWorker.run around nothing", "actor": "bare, in a plain Ray actor",
              "report": "one residency report"}
    for name, ms in medians.items():
        print(f"{labels[name]:34s} {ms:9.2f} ms")
    result = {"bench": "replica_cost", "calls": args.calls, "load_average": round(load, 2),
              **{f"{name}_ms": round(ms, 2) for name, ms in medians.items()}}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
