"""GET /v1/residency/picture: a replica's plan as SVG, behind the token, naming what is wrong otherwise."""
from __future__ import annotations

from fastapi.testclient import TestClient

from deployments.api.routes import build_api
from deployments.capacity.replica_report import ReplicaResidency
from offload_core.planner.measured_compute import MeasuredCompute
from offload_core.planner.picture import plan_picture
from offload_core.planner.search import PerformanceMode, plan_pipeline
from tests.deployments.fakes import TOKEN, FakeBoard, FakeStages, fake_config
from tests.offload_core.planner.test_picture import facts

REPLICA = "SERVE_REPLICA::fake-app#Denoiser#x1y2"


def _client(with_picture: bool = True) -> TestClient:
    plan = plan_pipeline(facts(), PerformanceMode.MEMORY)
    measured = {"dit": MeasuredCompute(tuple((f"blocks.{i}", 0.9) for i in range(6)), 0.4, (("blocks.0", 0.2),))}
    report = ReplicaResidency(REPLICA, "denoise", "cpu", "memory", plan.explain(), 1, 1, 0,
                              {"components": [], "totals": {}},
                              picture=plan_picture(plan, measured) if with_picture else None)
    api = build_api(fake_config(), FakeStages(), FakeBoard(reports=(report,)))
    return TestClient(api, headers={"Authorization": f"Bearer {TOKEN}"}, raise_server_exceptions=False)


def test_a_replicas_picture_is_svg_with_the_predicted_and_the_measured_pass():
    client = _client()
    for name in (REPLICA, "x1y2"):  # the full replica id, or the id Serve's logs show after the last '#'
        response = client.get("/v1/residency/picture", params={"replica": name})
        assert response.status_code == 200, response.text
        assert response.headers["content-type"].startswith("image/svg+xml")
        assert b"dit, predicted" in response.content and b"dit, measured (warm-up)" in response.content


def test_an_unknown_or_missing_replica_is_named_and_the_known_ones_listed():
    client = _client()
    missing = client.get("/v1/residency/picture")
    assert missing.status_code == 400 and missing.json()["error"]["param"] == "replica"
    unknown = client.get("/v1/residency/picture", params={"replica": "nope"})
    assert unknown.status_code == 404 and REPLICA in unknown.json()["error"]["message"]
    assert _client(with_picture=False).get("/v1/residency/picture", params={"replica": REPLICA}).status_code == 404


def test_the_picture_needs_the_token_like_the_rest():
    response = _client().get("/v1/residency/picture", params={"replica": REPLICA}, headers={"Authorization": ""})
    assert response.status_code == 401
