"""GET /v1/residency -> pending: a replica placed on a node but still starting after Serve's 30 s (loading,
or waiting for its node ledger's standing lease) is listed with why; a younger one is not."""
from __future__ import annotations

from deployments.capacity import unplaced

NOW = 10_000.0


def _details(*replicas: dict) -> dict:
    """Serve's details of one app as the controller sends them (the REST API's ServeInstanceDetails JSON)."""
    deployment = {"name": "Denoiser", "status": "UPDATING", "status_trigger": "CONFIG_UPDATE_STARTED", "message": "",
                  "deployment_config": {"name": "Denoiser", "ray_actor_options": {"num_cpus": 1, "num_gpus": 1}},
                  "target_num_replicas": len(replicas), "required_resources": {"CPU": 1, "GPU": 1},
                  "replicas": list(replicas)}
    return {"applications": {"app": {"name": "app", "route_prefix": "/", "docs_path": None, "status": "RUNNING",
                                     "message": "", "last_deployed_time_s": 1.0, "source": "declarative",
                                     "deployments": {"Denoiser": deployment}, "external_scaler_enabled": False}}}


def _replica(replica_id: str, node_id: str | None, started_s_ago: float) -> dict:
    return {"replica_id": replica_id, "state": "STARTING", "node_id": node_id,
            "actor_name": f"SERVE_REPLICA::{replica_id}", "start_time_s": NOW - started_s_ago}


def test_a_replica_still_starting_on_a_node_after_30_s_is_pending_with_why(monkeypatch):
    monkeypatch.setattr(unplaced, "gpu_nodes", lambda free=False: ())
    details = _details(_replica("slow", "ab12cd34ef", 95.0), _replica("young", "ab12cd34ef", 5.0))
    [pending] = unplaced.pending_replicas("app", now=NOW, details=details)
    assert (pending.deployment, pending.replica, round(pending.waiting_s)) == ("Denoiser", "slow", 95)
    assert pending.reason.startswith("placed on node ab12cd34 95 s ago and still starting")
    assert "node ledger" in pending.reason


def test_a_young_starting_replica_is_not_pending():
    assert unplaced.pending_replicas("app", now=NOW, details=_details(_replica("young", "n1", 5.0))) == ()
