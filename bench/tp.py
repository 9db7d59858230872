"""Tensor-parallel stage replicas: a rank's device weight bytes, and what the fan-out to the ranks costs.

``rank_weight_bytes_over_unsharded``: the text encoder's device weight bytes one rank holds at
tp 2 over the unsharded encoder's, measured on the tiny Wan's umT5 encoder (2 gloo ranks, each
loading its slice through transformers' DistributedConfig) and planned at real size (umT5-XXL, on
``meta``); target <= 0.55. ``fanout_overhead_ms``: the median encode call of a tp 2 stage (the
ShardGroup: a lock, one Ray call per rank, rank 0 answers) minus that of a tp 1 stage worker,
both on the tiny encoder on this machine's CPU, the same request, ``--calls`` each; on CPU the
two ranks also split the compute, so ``fanout_noop_ms`` times the fan-out alone (a call that does
nothing, through the ranks minus on the worker).

    OMP_NUM_THREADS=1 .venv/bin/python bench/tp.py --quick

The last line printed is one JSON object; a rank holding over its target share (measured or
planned at real size) exits 1 and is listed in its ``failed`` (``bench/checks.py``).
"""
from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import checks  # noqa: E402
from deployments.dev import local_ray  # noqa: E402

local_ray.use_token_auth()  # before Ray is imported: the driver reads its auth mode then

import ray  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from ray.util.placement_group import placement_group, remove_placement_group  # noqa: E402
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy  # noqa: E402

from deployments.app import AppArgs, StageArgs, resolve_model_folder, stage_configs  # noqa: E402
from deployments.models import families  # noqa: E402
from deployments.wire.spec import GenerationSpec, PipelineStage  # noqa: E402
from offload_core.residency.host_tables import device_weight_bytes  # noqa: E402
from offload_core.tensor_parallel.plans import load_rank  # noqa: E402

SPEC = GenerationSpec("bench", "a lighthouse on a cliff at dusk", "", 64, 64, 1, 2, 5.0, 7, 1)


def _rank_bytes(rank: int, world: int, init: str, folder: str, out: str) -> None:
    from transformers import UMT5EncoderModel

    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    try:
        model = load_rank(UMT5EncoderModel, folder, world, rank, subfolder="text_encoder", torch_dtype=torch.float32)
        torch.save(device_weight_bytes(model), os.path.join(out, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def tiny_rank_bytes(folder: Path) -> tuple[int, list[int]]:
    from transformers import UMT5EncoderModel

    whole = device_weight_bytes(UMT5EncoderModel.from_pretrained(folder, subfolder="text_encoder"))
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_rank_bytes, args=(2, f"{tmp}/init", str(folder), tmp), nprocs=2, join=True)
        return whole, [torch.load(f"{tmp}/rank{r}.pt") for r in range(2)]


def real_rank_fraction() -> float:
    from offload_core.planner.inputs import gpu_spec, real_model_facts

    facts = {tp: real_model_facts("wan2.1-t2v-14b", gpu_spec("L4"), 64 * 2**30, tp_size=tp)[0] for tp in (1, 2)}
    encoder = {tp: next(c for c in f.components if c.name == "text_encoder") for tp, f in facts.items()}
    total = {tp: e.non_layer_bytes + sum(layer.nbytes for layer in e.layers) for tp, e in encoder.items()}
    return total[2] / total[1]


@ray.remote(num_cpus=0)
class EncoderReplica:
    """A stage replica stand-in: the TextEncoder's own code path (a StageWorker, or a ShardGroup of ranks)."""

    def __init__(self, config):
        from deployments.replica.tensor_parallel.group import ShardGroup
        from deployments.replica.worker import StageWorker

        self.group = ShardGroup(config, f"bench-tp{config.tp_size}", config.tp_size) if config.tp_size > 1 else None
        self.worker = None if self.group else StageWorker(config)

    def encode_ms(self, calls: int) -> list[float]:
        from deployments.replica.stages import encode_on

        times = []
        for _ in range(calls):
            start = time.perf_counter()
            self.group.call(encode_on, SPEC) if self.group else encode_on(self.worker, SPEC)
            times.append((time.perf_counter() - start) * 1e3)
        return times

    def noop_ms(self, calls: int) -> list[float]:
        """The fan-out alone: a call that does nothing, on every rank (tp 2) or on the worker (tp 1)."""
        times = []
        for _ in range(calls):
            start = time.perf_counter()
            self.group.call(_noop) if self.group else _noop(self.worker)
            times.append((time.perf_counter() - start) * 1e3)
        return times

    def close(self) -> None:
        self.group.close() if self.group else self.worker.close()


def _noop(worker) -> None:
    return None


def call_ms(folder: Path, tp: int, calls: int) -> tuple[float, float]:
    args = AppArgs(model_path=str(folder), encoder=StageArgs(tp_size=tp))
    config = stage_configs(args, families.read_family_traits(folder))[PipelineStage.ENCODE]
    group = placement_group([{"CPU": 0.01}] * tp, strategy="STRICT_PACK")
    ray.get(group.ready())
    stage = EncoderReplica.options(scheduling_strategy=PlacementGroupSchedulingStrategy(group, 0)).remote(config)
    try:
        stage_ms = ray.get(stage.encode_ms.remote(calls + 2))[2:]  # the first two warm the allocator
        noop_ms = ray.get(stage.noop_ms.remote(calls + 2))[2:]
        ray.get(stage.close.remote())
        return statistics.median(stage_ms), statistics.median(noop_ms)
    finally:
        ray.kill(stage)
        remove_placement_group(group)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="10 calls per stage")
    parser.add_argument("--calls", type=int)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    result = measure(args.calls or (10 if args.quick else 40))
    return checks.finish(result, verdict(result))


RANK_SHARE_TARGET = 0.55  # of the unsharded encoder's device weight bytes, per rank at tp 2


def verdict(result: dict) -> list[checks.TargetCheck]:
    return [checks.at_most("rank_weight_bytes_over_unsharded", result["rank_weight_bytes_over_unsharded"],
                           RANK_SHARE_TARGET),
            checks.at_most("real_umt5_xxl_rank_over_unsharded", result["real_umt5_xxl_rank_over_unsharded"],
                           RANK_SHARE_TARGET)]


def measure(calls: int) -> dict:
    """Both figures on this machine (a local Ray cluster started and stopped here); prints them."""
    folder = resolve_model_folder(AppArgs())
    whole, ranks = tiny_rank_bytes(folder)
    real = real_rank_fraction()
    local_ray.init_local(num_cpus=2, include_dashboard=False, object_store_memory=100 * 2**20, log_to_driver=False,
                         namespace="offload-serve-bench")
    try:
        (one, noop_one), (two, noop_two) = call_ms(folder, 1, calls), call_ms(folder, 2, calls)
    finally:
        ray.shutdown()
    result = {
        "rank_weight_bytes_over_unsharded": round(max(ranks) / whole, 4),
        "rank_weight_bytes": ranks, "unsharded_weight_bytes": whole,
        "real_umt5_xxl_rank_over_unsharded": round(real, 4),
        "encode_ms_tp1": round(one, 2), "encode_ms_tp2": round(two, 2),
        "fanout_overhead_ms": round(two - one, 2),
        # The fan-out alone (lock + one Ray call per rank, rank 0 answers) for a call that does nothing.
        "fanout_noop_ms": round(noop_two - noop_one, 3), "calls": calls, "backend": "gloo (CPU)",
        "load_average": round(os.getloadavg()[0], 1),
    }
    print(f"rank 0/1 hold {ranks} B of {whole} B unsharded ({result['rank_weight_bytes_over_unsharded']}); "
          f"umT5-XXL planned per rank at {result['real_umt5_xxl_rank_over_unsharded']} of its bytes")
    print(f"encode: tp 1 {one:.2f} ms, tp 2 {two:.2f} ms (median of {calls}), difference {two - one:.2f} ms; "
          f"a call doing nothing: {noop_one:.3f} ms vs {noop_two:.3f} ms through the ranks")
    return result


if __name__ == "__main__":
    sys.exit(main())
