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
