"""GPU shares against the cluster's GPUs: build_app's warning, and why a replica is pending."""
from __future__ import annotations

import logging

from fastapi.testclient import TestClient

from deployments.api.routes import build_api
from deployments.capacity.gpu_shares import GpuDemand, GpuNode, PendingReplica, Shortfall, shortfalls, why_pending
from deployments.capacity.unplaced import demand_of, warn_if_unplaceable
from tests.deployments.fakes import FakeBoard, FakeStages, fake_config

ONE_GPU = (GpuNode("node-one-gpu-0000", 1, 1.0),)
STAGES = ("TextEncoder", "Denoiser", "VaeDecoder")


def _gpu(name, num_gpus, replicas=1, accelerator_type=None) -> GpuDemand:
    return GpuDemand(name, num_gpus, replicas, accelerator_type)


def test_fractions_pack_per_gpu_not_over_the_clusters_total():
    # 0.6 + 0.6 = 1.2 of two GPUs' 2.0 in all, but a fraction never spans GPUs: 0.6 + 0.6 needs two GPUs.
    two_nodes = (GpuNode("a" * 16, 1, 1.0), GpuNode("b" * 16, 1, 1.0))
    assert shortfalls([_gpu("Denoiser", 0.6, 2)], two_nodes) == ()
    assert shortfalls([_gpu("Denoiser", 0.6, 3)], two_nodes) == (Shortfall("Denoiser", 0.6, 3, 2),)
    # 0.2 + 0.6 + 0.2 is exactly one GPU (counted in Ray's 1/10000 units, no float rounding).
    assert shortfalls([_gpu("TextEncoder", 0.2), _gpu("Denoiser", 0.6), _gpu("VaeDecoder", 0.2)], ONE_GPU) == ()
    assert shortfalls([_gpu("Denoiser", 0.6, 4), _gpu("VaeDecoder", 0.2)], ONE_GPU) == (
        Shortfall("Denoiser", 0.6, 4, 1),)


def test_whole_gpus_come_from_one_node_and_accelerator_types_restrict_the_nodes():
    nodes = (GpuNode("a" * 16, 2, 2.0, frozenset({"L4"})), GpuNode("b" * 16, 1, 1.0, frozenset({"H100"})))
    assert shortfalls([_gpu("Denoiser", 2)], nodes) == ()
    assert shortfalls([_gpu("Denoiser", 2, 2)], nodes) == (Shortfall("Denoiser", 2, 2, 1),), "2 + 2 > one node's 2"
    assert shortfalls([_gpu("Denoiser", 0.5, 3, "H100")], nodes) == (Shortfall("Denoiser", 0.5, 3, 2),)
    assert shortfalls([_gpu("Denoiser", 0.5, 1, "A10G")], nodes) == (Shortfall("Denoiser", 0.5, 1, 0),)


def test_build_app_warns_once_with_the_numbers_when_the_configured_maximum_can_never_be_placed(caplog):
    build = {name: {"ray_actor_options": {"num_cpus": 0.25}} for name in (*STAGES, "Ingress")}
    # The config file's options (what Serve applies over build_app's): four 0.6 Denoisers on one GPU.
    overrides = {"TextEncoder": {"ray_actor_options": {"num_gpus": 0.2}},
                 "Denoiser": {"ray_actor_options": {"num_gpus": 0.6},
                              "autoscaling_config": {"min_replicas": 1, "max_replicas": 4}},
                 "VaeDecoder": {"ray_actor_options": {"num_gpus": 0.2}, "num_replicas": 1}}
    with caplog.at_level(logging.WARNING, logger="deployments.capacity.unplaced"):
        warning = warn_if_unplaceable("app", build, overrides=overrides, nodes=ONE_GPU, autoscaler=False)
    (record,) = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert record.getMessage() == f"app: {warning}"
    assert "Denoiser wants 4 x 0.6 GPU, at most 1 can be placed" in warning
    assert "1 GPU(s) on 1 node(s), no autoscaler; 2.8 GPU asked in all" in warning
    assert "TextEncoder" not in warning and "VaeDecoder" not in warning
    caplog.clear()
    fits = {**overrides, "Denoiser": {"ray_actor_options": {"num_gpus": 0.6}, "num_replicas": 1}}
    assert warn_if_unplaceable("app", build, overrides=fits, nodes=ONE_GPU, autoscaler=False) is None
    assert warn_if_unplaceable("app", build, overrides=overrides, nodes=ONE_GPU, autoscaler=True) is None
    assert not [r for r in caplog.records if r.levelno == logging.WARNING], "no warning when it fits or autoscales"


def test_a_deployments_maximum_is_its_autoscaling_max_or_its_replica_count():
    assert demand_of("D", {"ray_actor_options": {"num_gpus": 0.5}, "num_replicas": 3}) == _gpu("D", 0.5, 3)
    assert demand_of("D", {"ray_actor_options": {"num_gpus": 0.5, "accelerator_type": "L4"},
                           "autoscaling_config": {"min_replicas": 0, "max_replicas": 5}}) == _gpu("D", 0.5, 5, "L4")
    assert demand_of("D", {"num_replicas": "auto"}) == _gpu("D", 0.0, 100)
    assert demand_of("D", {}) == _gpu("D", 0.0, 1)


def test_a_pending_replicas_reason_names_each_node_and_its_free_share():
    nodes = (GpuNode("0123456789abcdef", 1, 0.4), GpuNode("fedcba9876543210", 0, 0.0))
    reason = why_pending(_gpu("Denoiser", 0.6), nodes)
    assert reason == ("wants 0.6 GPU on one GPU; no alive node has it free: node 01234567 has 0.4 of 1 GPU(s) free, "
                      "node fedcba98 has no GPU")
    assert "node 01234567 is not H100" in why_pending(_gpu("Denoiser", 0.2, 1, "H100"), nodes)
    assert "waiting for Ray to start its worker" in why_pending(_gpu("Denoiser", 0.2), nodes)
    # Two GPUs with 0.4 free each: 0.8 in all, yet no GPU holds 0.6; only the sum is known, so it says so.
    split = why_pending(_gpu("Denoiser", 0.6), (GpuNode("0123456789abcdef", 2, 0.8),))
    assert split == ("wants 0.6 of one GPU; node 01234567 has 0.8 free across its 2 GPUs: placed once one of "
                     "them has 0.6 free")


def test_residency_lists_pending_replicas_with_what_they_want_and_why():
    pending = PendingReplica("Denoiser", "abc123", (("CPU", 2.0), ("GPU", 0.6)), 12.34,
                             "wants 0.6 GPU on one GPU; no alive node has it free: node 01234567 has 0.4 of 1 "
                             "GPU(s) free")
    client = TestClient(build_api(fake_config(token=None), FakeStages(), FakeBoard(pending=(pending,))))
    body = client.get("/v1/residency").json()
    assert body["replicas"] == []
    assert body["pending"] == [{"deployment": "Denoiser", "replica": "abc123", "wanted": {"CPU": 2.0, "GPU": 0.6},
                                "waiting_s": 12.3, "reason": pending.reason}]
