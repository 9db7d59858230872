"""Health that tells the truth, over fake stages: a stage down is a 503 everywhere, at once, and says why."""
from __future__ import annotations

from fastapi.testclient import TestClient

from deployments.api.routes import build_api
from deployments.api.serving import ServingState, StageDown
from tests.deployments.fakes import TOKEN, FakeBoard, FakeStages, fake_config

AUTH = {"Authorization": f"Bearer {TOKEN}"}
DOWN = ServingState((StageDown("Denoiser", "DEPLOY_FAILED", "replica failed to start: SafetensorError"),))


class FakeCheck:
    def __init__(self, state: ServingState = ServingState()):
        self.now = state

    def state(self) -> ServingState:
        return self.now

    async def confirm(self) -> ServingState:
        return self.now


def _client(check: FakeCheck) -> tuple[TestClient, FakeStages]:
    stages = FakeStages()
    api = build_api(fake_config(), stages, FakeBoard(), serving=check)
    return TestClient(api, headers=AUTH, raise_server_exceptions=False), stages


def _error(response, status: int) -> dict:
    assert response.status_code == status, response.text
    assert set(response.json()) == {"error"}, response.text
    return response.json()["error"]


def test_a_stage_that_is_down_makes_health_a_503_naming_it_and_serves_reason():
    client, _ = _client(FakeCheck(DOWN))
    error = _error(client.get("/health"), 503)
    assert error["code"] == "stage_not_running" and error["type"] == "overloaded"
    assert "stage Denoiser is not running (failed to deploy: replica failed to start: SafetensorError)" in error["message"]
    assert client.get("/health").headers["retry-after"] == "1"


def test_while_a_stage_is_down_models_say_not_serving_and_new_work_is_refused_at_once():
    client, stages = _client(FakeCheck(DOWN))
    (card,) = client.get("/v1/models").json()["data"]
    assert card["serving"] is False and "stage Denoiser is not running" in card["not_serving"]
    for path, body in (("/v1/images/generations", {"prompt": "a fox"}),
                       ("/v1/videos/generations", {"prompt": "a fox"}),
                       ("/v1/videos", {"prompt": "waves", "seconds": "1"}),
                       ("/v1/videos/edits", {"prompt": "waves", "video": {"id": "video_" + "0" * 24}}),
                       ("/v1/videos/extensions", {"prompt": "waves", "seconds": "1", "video": {"id": "x"}}),
                       ("/v1/videos/video_" + "0" * 24 + "/remix", {"prompt": "waves"})):
        response = client.post(path, json=body)
        assert _error(response, 503)["code"] == "stage_not_running", path
        assert response.headers["retry-after"] == "1"
    assert stages.calls == [], "nothing reached a stage"


def test_a_request_without_the_token_is_still_a_401_while_a_stage_is_down():
    client, _ = _client(FakeCheck(DOWN))
    assert client.post("/v1/images/generations", json={"prompt": "a fox"}, headers={"Authorization": ""}
                       ).status_code == 401


def test_before_the_first_reading_and_after_recovery():
    check = FakeCheck(ServingState(known=False))
    client, stages = _client(check)
    assert "not known yet" in _error(client.get("/health"), 503)["message"]
    check.now = ServingState()
    assert client.get("/health").json() == {"status": "ok", "model": "tiny-wan"}
    assert client.get("/v1/models").json()["data"][0]["serving"] is True
    response = client.post("/v1/images/generations", json={"prompt": "a fox", "size": "16x16"})
    assert response.status_code == 200, response.text
    assert [stage for stage, _ in stages.calls] == ["encode", "denoise", "decode"]
