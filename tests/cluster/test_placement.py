"""Stages land on the GPU type their config asks for."""
from __future__ import annotations

import pytest
import ray

from cluster.placement import actor_options, load_stage_placements, stage_placement
from tests.cluster.conftest import FAST
from tests.cluster.replicas import LeasingReplica


def test_placement_config_errors_are_named():
    with pytest.raises(ValueError, match="unknown placement keys"):
        stage_placement("denoiser", {"gpu_typo": "L4"})
    with pytest.raises(ValueError, match="num_gpus=0"):
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
