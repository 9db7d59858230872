"""Stages land on the GPU type their config asks for; each GPU type plans for itself."""
from __future__ import annotations

import pytest
import ray

from cluster.fleet import load_fleet, profile_for_gpu
from cluster.node import GpuFacts
from cluster.placement import actor_options, load_stage_placements, stage_placement
from offload_core.planner_facts import ComponentProfile, LayerFacts, Stage
from tests.cluster.conftest import FAST
from tests.cluster.replicas import LeasingReplica, on_node

GB = 10**9


def _gpu(name: str, memory_gb: float) -> GpuFacts:
    return GpuFacts(0, name, int(memory_gb * GB), 4, 16, "test")


@pytest.mark.parametrize("name, memory_gb, profile", [
    ("NVIDIA GeForce RTX 3060", 12.88, "consumer-12gb"),
    ("NVIDIA L4", 24.15, "l4-a10g-24gb"),
    ("NVIDIA A10G", 23.8, "l4-a10g-24gb"),
    ("NVIDIA L40S", 48.3, "l40s-48gb"),  # "L4" must not match "L40S"
    ("NVIDIA H100 80GB HBM3", 85.5, "a100-h100-80gb"),
    ("NVIDIA A100-SXM4-80GB", 85.1, "a100-h100-80gb"),
    ("NVIDIA H200", 150.0, "h200-141gb"),
    ("NVIDIA RTX A5000", 25.4, "l4-a10g-24gb"),  # unlisted: by memory class
    ("NVIDIA A100-SXM4-40GB", 42.5, "l4-a10g-24gb"),  # below the 48 GB class
])
def test_a_replica_picks_its_profile_from_the_gpu_it_sees(name, memory_gb, profile):
    assert profile_for_gpu(_gpu(name, memory_gb)).name == profile


def test_the_fleet_covers_every_class_and_no_gpu():
    fleet = load_fleet()
    assert [p.min_memory_gb for p in fleet.profiles] == [12, 24, 48, 80, 141]
    assert profile_for_gpu(None).name == fleet.cpu_profile.name
    modes = {p.name: p.mode for p in fleet.profiles}
    assert modes["consumer-12gb"] == "MEMORY" and modes["a100-h100-80gb"] == "SPEED"


def test_placement_config_errors_are_named():
    with pytest.raises(ValueError, match="unknown placement keys"):
        stage_placement("denoiser", {"gpu_typo": "L4"})
    with pytest.raises(AssertionError, match="num_gpus=0"):
        stage_placement("denoiser", {"gpu_type": "L4", "num_gpus": 0})


def test_each_stage_lands_on_the_gpu_type_its_config_asks_for(fleet_nodes):
    placements = load_stage_placements()
    by_type = {n.accelerator_type: n.node_id for n in (fleet_nodes.small, fleet_nodes.l4, fleet_nodes.big)}
    assert placements["denoiser"].accelerator_type == "L4"
    assert placements["text_encoder"].accelerator_type == "RTX3060"  # from the profile's name
    replicas = {stage: LeasingReplica.options(**actor_options(p)).remote(stage, FAST)
                for stage, p in placements.items()}
    try:
        for stage, replica in replicas.items():
            facts = ray.get(replica.facts.remote(), timeout=120)
            assert facts["node_id"] == by_type[placements[stage].accelerator_type], stage
            assert facts["pool"] == "gpu:0", f"{stage} must lease the GPU it was placed on"
    finally:
        for replica in replicas.values():
            ray.kill(replica)


def _denoiser_14b() -> ComponentProfile:
    """Wan2.1-14B-like: 40 blocks of 0.7 GB bf16 (28 GB), 50 steps, 20 ms per block per step."""
    layers = tuple(LayerFacts(f"blocks.{i}", (("bfloat16", 700_000_000),), 700_000_000, 350_000_000)
                   for i in range(40))
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
