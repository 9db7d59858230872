"""GET /v1/residency on a mixed fleet: each replica of one deployment says which GPU type it plans for."""
from __future__ import annotations

from fastapi.testclient import TestClient

from deployments.api.routes import build_api
from deployments.capacity.replica_report import ReplicaResidency
from tests.deployments.fakes import TOKEN, FakeBoard, FakeStages, fake_config


def _report(replica: str, gpu_type: str, mode: str) -> ReplicaResidency:
    return ReplicaResidency(f"SERVE_REPLICA::fake-app#Denoiser#{replica}", "denoise", "cuda:0", mode, (), 1, 1, 0,
                            {"components": [], "totals": {}}, gpu_type=gpu_type)


def test_each_denoiser_replica_reports_its_gpu_type_beside_its_plan_mode():
    board = FakeBoard(reports=(_report("a1", "L4", "balanced"), _report("b2", "H100", "speed")))
    client = TestClient(build_api(fake_config(), FakeStages(), board), headers={"Authorization": f"Bearer {TOKEN}"})
    response = client.get("/v1/residency")
    assert response.status_code == 200, response.text
    said = {r["replica"].rsplit("#", 1)[1]: (r["stage"], r["gpu_type"], r["mode"]) for r in response.json()["replicas"]}
    assert said == {"a1": ("denoise", "L4", "balanced"), "b2": ("denoise", "H100", "speed")}
