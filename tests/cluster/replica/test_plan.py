"""Each GPU type plans for itself: the same pipeline streams on 12 GB and stays resident on 80 GB."""
from __future__ import annotations

import ray
import torch

from offload_core.planner.facts import ComponentProfile, Stage
from tests.cluster.conftest import FAST
from tests.cluster.replicas import on_node
from tests.offload_core.tiny_models import toy_layer

GB = 10**9


def _denoiser_14b() -> ComponentProfile:
    """Wan2.1-14B-like: 40 blocks of 0.7 GB bf16 (28 GB), 50 steps, 20 ms per block per step."""
    layers = tuple(toy_layer(f"blocks.{i}", 700_000_000, torch.bfloat16) for i in range(40))
    return ComponentProfile("transformer", "WanTransformer3DModel", ("blocks",), layers, 500_000_000, 0, 50,
                            (0.02,) * 40)


def test_a_12gb_replica_and_an_80gb_replica_choose_different_plans(fleet_nodes):
    small = on_node(fleet_nodes.small.node_id, num_gpus=1).remote("denoiser-12gb", FAST)
    big = on_node(fleet_nodes.big.node_id, num_gpus=1).remote("denoiser-80gb", FAST)
    stages = [Stage("denoise", ("transformer",))]
    try:
        plans = ray.get([r.plan.remote([_denoiser_14b()], stages, 2 * GB) for r in (small, big)], timeout=120)
    finally:
        ray.kill(small)
        ray.kill(big)
    on_12, on_80 = plans
    assert (on_12["mode"], on_80["mode"]) == ("memory", "speed")
    assert on_12["strategies"]["transformer"] == "layerwise", "28 GB of weights must stream on a 12 GB card"
    assert on_80["strategies"]["transformer"] == "resident", "an 80 GB card holds 28 GB of weights"
    assert on_12["feasible"] and on_80["feasible"]
    assert on_12["peak"] <= on_12["capacity"] < 12 * GB < on_80["capacity"]
