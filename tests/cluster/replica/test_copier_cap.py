"""The replica's copier thread cap: the node's cores shared among the replicas its GPUs hold."""
from __future__ import annotations

from types import SimpleNamespace

from cluster.replica.plan import copier_cap, replicas_sharing_node
from offload_core.streaming import fill_threads


def _memory(gpus: int, fraction: float | None):
    return SimpleNamespace(owner="r", gpu_fraction=fraction, node=SimpleNamespace(gpus=(object(),) * gpus))


def test_replicas_sharing_a_node_count_one_per_gpu_or_per_gpu_share():
    assert replicas_sharing_node(_memory(0, None)) == 1
    assert replicas_sharing_node(_memory(8, None)) == 8
    assert replicas_sharing_node(_memory(8, 1.0)) == 8
    assert replicas_sharing_node(_memory(2, 0.5)) == 4
    assert replicas_sharing_node(_memory(1, 0.3)) == 3


def test_the_cap_divides_the_cores_among_them(monkeypatch):
    monkeypatch.setattr(fill_threads, "usable_cpus", lambda: 16)
    assert copier_cap(_memory(1, None)) == 8, "alone on 16 cores: the default cap"
    assert copier_cap(_memory(8, None)) == 2, "8 GPUs' replicas on 16 cores: two threads each"
    assert copier_cap(_memory(8, 0.25)) == 1


def test_the_plan_says_what_ray_gave_the_process_and_what_the_engine_chose(monkeypatch):
    import os

    import torch

    from cluster.fleet import FleetProfile
    from cluster.replica.plan import plan_for_replica, process_note
    from offload_core.planner.facts import ComponentProfile, LinkFacts, PipelineFacts, Stage
    from tests.offload_core.tiny_models import toy_layer

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    link = LinkFacts(25e9, 8e9, measured=False, copier_threads=4)
    note = process_note(link)
    assert note == (f"process: nice {os.nice(0)}, {torch.get_num_threads()} intra-op thread(s) for compute "
                    "(OMP_NUM_THREADS=1, as Ray set it); the engine's staging fills split over 4 copier thread(s) "
                    "of their own")
    layers = tuple(toy_layer(f"blocks.{i}", 1_000_000, torch.float32) for i in range(4))
    profile = ComponentProfile("transformer", "Toy", ("blocks",), layers, 0, 0, 2, (0.001,) * 4)
    facts = PipelineFacts((profile,), (Stage("denoise", ("transformer",)),), 10**9, link, 10**9)
    plan = plan_for_replica(FleetProfile("test", ("cpu",), 0, None, "MEMORY", 1.0, 1, 0.5, 0.0), facts)
    assert note in plan.explain()
