"""LoRA adapters over HTTP: chosen by configured name in the body, listed by GET /v1/models, refused
(4xx in the OpenAI error shape naming the field) when unknown; over fake stages, no Ray."""
from __future__ import annotations

import asyncio
import dataclasses

import pytest
from fastapi.testclient import TestClient

from deployments.api.routes import build_api
from deployments.capacity.replica_report import AdapterResidency, ReplicaResidency
from deployments.models.lora_rows import ServedLora
from tests.deployments.fakes import TOKEN, FakeBoard, FakeStages, fake_config
from tests.deployments.video_fakes import harness

IMAGES, VIDEOS = "/v1/images/generations", "/v1/videos/generations"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
LORAS = (ServedLora("ink", "/srv/loras/ink.safetensors", 0.8), ServedLora("neon", "/srv/loras/neon", 1.0))


def _client(loras=LORAS) -> tuple[TestClient, FakeStages]:
    stages = FakeStages()
    config = dataclasses.replace(fake_config(), loras=loras)
    return TestClient(build_api(config, stages, FakeBoard()), headers=AUTH, raise_server_exceptions=False), stages


def _error(response, status: int) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]


def test_models_lists_the_configured_adapters_by_name_and_scale_never_their_paths():
    client, _ = _client()
    (card,) = client.get("/v1/models").json()["data"]
    assert card["loras"] == [{"name": "ink", "scale": 0.8}, {"name": "neon", "scale": 1.0}]
    assert "/srv/loras" not in client.get("/v1/models").text


def test_a_named_adapter_reaches_the_denoiser_with_its_configured_scale_or_the_requests():
    client, stages = _client()
    assert client.post(IMAGES, json={"prompt": "a fox", "lora": "ink"}).status_code == 200
    assert client.post(IMAGES, json={"prompt": "a fox", "lora": "neon", "lora_scale": -0.5}).status_code == 200
    assert client.post(VIDEOS, json={"prompt": "a fox", "lora": "neon", "num_frames": 5}).status_code == 200
    assert client.post(IMAGES, json={"prompt": "a fox"}).status_code == 200
    assert [(s.lora, s.lora_scale) for s in stages.specs.values()] == [("ink", 0.8), ("neon", -0.5), ("neon", 1.0),
                                                               (None, 1.0)]


@pytest.mark.parametrize("route", [IMAGES, VIDEOS])
def test_an_unknown_adapter_is_a_404_naming_the_field_and_the_served_ones(route):
    client, stages = _client()
    error = _error(client.post(route, json={"prompt": "a fox", "lora": "../../etc/passwd"}), 404)
    assert error["param"] == "lora" and error["code"] == "lora_not_found"
    assert "ink, neon" in error["message"]
    assert stages.calls == []  # refused before any stage ran


def test_no_adapter_is_known_when_none_is_configured():
    client, _ = _client(loras=())
    error = _error(client.post(IMAGES, json={"prompt": "a fox", "lora": "ink"}), 404)
    assert error["param"] == "lora" and "none are configured" in error["message"]
    assert client.get("/v1/models").json()["data"][0]["loras"] == []


@pytest.mark.parametrize("body, param", [
    ({"lora_scale": 1.0}, "lora_scale"),  # a scale without an adapter
    ({"lora": "ink", "lora_scale": 4.5}, "lora_scale"),  # beyond MAX_LORA_SCALE
    ({"lora": "ink", "lora_scale": "strong"}, "lora_scale"),
    ({"lora": 3}, "lora"),
])
def test_a_bad_adapter_field_is_a_400_naming_it(body, param):
    client, _ = _client()
    assert _error(client.post(IMAGES, json={"prompt": "a fox", **body}), 400)["param"] == param


def test_residency_lists_each_replicas_adapters_with_their_bytes_and_place():
    loras = (AdapterResidency("ink", 1 << 20, "cuda:0", 16), AdapterResidency("neon", 2 << 20, "host", 32))
    board = FakeBoard((ReplicaResidency("den-1", "denoise", "cuda:0", "memory", (), 0, 0, 0, {}, loras=loras),
                       ReplicaResidency("enc-1", "encode", "cuda:0", "memory", (), 0, 0, 0, {})))
    client = TestClient(build_api(fake_config(), FakeStages(), board), headers=AUTH)
    denoiser, encoder = client.get("/v1/residency").json()["replicas"]
    assert denoiser["loras"] == [{"name": "ink", "bytes": 1 << 20, "place": "cuda:0", "rank": 16},
                                 {"name": "neon", "bytes": 2 << 20, "place": "host", "rank": 32}]
    assert "loras" not in encoder


def test_a_video_job_carries_its_adapter_to_the_denoiser_and_an_unknown_one_is_refused_at_creation(tmp_path):
    stages = FakeStages()

    async def scenario():
        async with harness(tmp_path, stages=stages, loras=LORAS) as h:
            created = await h.client.post("/v1/videos", json={"prompt": "waves", "lora": "ink"})
            assert created.status_code == 200, created.text
            assert (await h.wait_for(created.json()["id"]))["status"] == "completed"
            refused = await h.client.post("/v1/videos", json={"prompt": "waves", "lora": "mist"})
            assert refused.status_code == 404 and refused.json()["error"]["param"] == "lora"

    asyncio.run(scenario())
    assert [(s.lora, s.lora_scale) for s in stages.specs.values()] == [("ink", 0.8)]
