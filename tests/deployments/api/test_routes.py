"""The HTTP API over fake stages: answers, SSE, error mapping, auth, content types, CORS."""
from __future__ import annotations

import asyncio
import base64
import io
import json
import logging
import threading

import pytest
from fastapi.testclient import TestClient
from PIL import Image
from ray import exceptions as ray_errors
from ray.serve.exceptions import BackPressureError

from cluster.replica.ledger_view import DeviceBusy
from deployments.api import routes
from deployments.wire import media
from deployments.wire.spec import GenerationSpec, RequestRejected
from offload_core.host.budget import Refusal
from tests.deployments.fakes import TOKEN, FakeStages, fake_api

IMAGES, VIDEOS, EDITS = "/v1/images/generations", "/v1/videos/generations", "/v1/images/edits"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def _busy(owner: str, nbytes: int, waited_s: float) -> DeviceBusy:
    """The replica's DeviceBusy: a working set refused after a bounded wait (Retry-After: the wait)."""
    return DeviceBusy(owner, "gpu:0", nbytes, Refusal(owner, nbytes, 0, "held by a neighbour"), waited_s)


def _client(stages: FakeStages | None = None, **kwargs) -> tuple[TestClient, FakeStages]:
    api, stages = fake_api(stages, **kwargs)
    return TestClient(api, headers=AUTH, raise_server_exceptions=False), stages


def _error(response, status: int) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]


def _events(text: str) -> list[tuple[str, dict]]:
    return [(block.split("\n")[0][len("event: "):], json.loads(block.split("\n")[1][len("data: "):]))
            for block in text.strip().split("\n\n")]


def test_an_image_request_runs_every_stage_and_returns_pngs_of_the_asked_size():
    client, stages = _client()
    response = client.post(IMAGES, json={"prompt": "a fox", "size": "32x16", "n": 2},
                           headers={"X-Request-Id": "req-42"})
    assert response.status_code == 200, response.text
    assert [Image.open(io.BytesIO(base64.b64decode(d["b64_json"]))).size for d in response.json()["data"]] == \
        [(32, 16), (32, 16)]
    assert stages.calls == [("encode", "req-42"), ("denoise", "req-42"), ("decode", "req-42")]
    assert response.json()["id"] == "req-42" and response.headers["x-request-id"] == "req-42"


class _CountedEncoderOutput:
    """The encoder's awaitable, counting who reads it (with Serve: a fetch of its tensors)."""

    def __init__(self, inner):
        self.inner, self.reads = inner, 0

    def __await__(self):
        self.reads += 1
        return self.inner.__await__()


class _CountingStages(FakeStages):
    def encode(self, spec):
        self.encoded = _CountedEncoderOutput(super().encode(spec))
        return self.encoded


def test_every_stage_is_reported_though_only_the_denoiser_reads_the_encoders_output():
    client, stages = _client(_CountingStages())
    response = client.post(IMAGES, json={"prompt": "a fox", "size": "32x16"})
    assert response.status_code == 200, response.text
    assert [s["stage"] for s in response.json()["stages"]] == ["encode", "denoise", "decode"]
    assert stages.encoded.reads == 1, "the ingress fetched the prompt embeddings too"


class _ProgressRecordingStages(FakeStages):
    def denoise(self, encoded, spec, progress: bool = True):
        self.asked_progress = progress
        return super().denoise(encoded, spec, progress)


def test_only_a_caller_that_reads_the_steps_asks_the_denoiser_for_progress_events():
    client, stages = _client(_ProgressRecordingStages())
    assert client.post(IMAGES, json={"prompt": "a fox"}).status_code == 200
    assert stages.asked_progress is False
    with client.stream("POST", IMAGES, json={"prompt": "a fox", "stream": True, "num_inference_steps": 2}) as r:
        steps = [e for e, _ in _events(r.read().decode()) if e == "progress"]
    assert stages.asked_progress is True and len(steps) == 2


def test_a_few_small_images_are_encoded_on_the_event_loop_and_larger_ones_in_a_thread(monkeypatch):
    encoded_on, real = {}, media.image_bytes

    def recording(image, *args):
        encoded_on.setdefault(tuple(image.shape[:2]), set()).add(threading.current_thread().name)
        return real(image, *args)

    class _LoopStages(FakeStages):
        async def decode(self, latents, spec):
            self.loop_threads[(spec.height, spec.width)] = threading.current_thread().name
            return await super().decode(latents, spec)

    monkeypatch.setattr(media, "image_bytes", recording)
    monkeypatch.setattr(routes, "INLINE_RENDER_VALUES", 32 * 32 * 3)  # the fake limits stop at 64x64
    client, stages = _client(_LoopStages())
    stages.loop_threads = {}
    for size in ("32x32", "64x64"):
        assert client.post(IMAGES, json={"prompt": "a fox", "size": size}).status_code == 200
    assert encoded_on[(32, 32)] == {stages.loop_threads[(32, 32)]}
    assert stages.loop_threads[(64, 64)] not in encoded_on[(64, 64)]


class _LingeringStages(FakeStages):
    """A Denoiser call whose stream stays open after the latents (its end is one more message)."""

    def denoise(self, encoded, spec, progress: bool = True):
        async def stream():
            async for item in super(_LingeringStages, self).denoise(encoded, spec, progress):
                yield item
            await asyncio.Event().wait()  # never ends

        return stream()


def test_the_answer_does_not_wait_for_the_denoisers_stream_to_end_after_the_latents():
    api, _ = fake_api(_LingeringStages())
    spec = GenerationSpec("linger", "a fox", None, 32, 32, 1, 2, 5.0, 0, 1)
    generated = asyncio.run(asyncio.wait_for(api.state.service.generate(spec), timeout=10))
    assert [s.stage for s in generated.stats] == ["encode", "denoise", "decode"]


def test_an_event_stream_sends_accepted_each_step_then_the_result():
    client, _ = _client()
    with client.stream("POST", IMAGES, json={"prompt": "a tree", "stream": True, "num_inference_steps": 3}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = _events("".join(r.iter_text()))
    assert [name for name, _ in events] == ["accepted", "progress", "progress", "progress",
                                            "image_generation.completed"]
    assert [data["message"] for name, data in events if name == "progress"] == \
        ["step 1 of 3", "step 2 of 3", "step 3 of 3"]
    assert all(data["type"] == name for name, data in events)


def test_a_video_event_stream_closes_with_one_result_holding_the_synchronous_body():
    client, _ = _client()
    body = {"prompt": "waves", "size": "32x32", "num_frames": 5, "seed": 2, "num_inference_steps": 2}
    with client.stream("POST", VIDEOS, json={**body, "stream": True}) as r:
        events = _events("".join(r.iter_text()))
    assert [name for name, _ in events] == ["accepted", "progress", "progress", "result"]
    result = events[-1][1]
    plain = client.post(VIDEOS, json=body).json()
    assert result["type"] == "result" and result["data"] == plain["data"]
    assert media.check_mp4(base64.b64decode(result["data"][0]["b64_json"])) is None


@pytest.mark.parametrize("stage, exc, status, code", [
    ("denoise", _busy("denoise#1", 100, 3.0), 503, "device_busy"),
    ("encode", BackPressureError(num_queued_requests=4, max_queued_requests=4), 503, "queue_full"),
    ("decode", ray_errors.ActorDiedError(), 503, "replica_unavailable"),
    ("encode", ray_errors.RayTaskError("encode", "tb", RequestRejected("prompt", "cannot be tokenized")), 400,
     "invalid_value"),
])
def test_a_stage_failure_maps_to_its_status_and_code(stage, exc, status, code):
    client, _ = _client(FakeStages(fail={stage: exc}))
    error = _error(client.post(IMAGES, json={"prompt": "a cat"}), status)
    assert error["code"] == code
    if status == 503:
        assert int(client.post(IMAGES, json={"prompt": "a cat"}).headers["retry-after"]) >= 1
    if status == 400:
        assert error["param"] == "prompt"


def test_an_unexpected_stage_error_is_a_500_whose_request_id_is_in_the_log(caplog):
    client, _ = _client(FakeStages(fail={"decode": RuntimeError("bug in decode")}))
    with caplog.at_level(logging.ERROR, logger="deployments.api.errors"):
        response = client.post(IMAGES, json={"prompt": "a cat"}, headers={"X-Request-Id": "boom-7"})
    error = _error(response, 500)
    assert "boom-7" in error["message"] and error["type"] == "server_error"
    assert any("boom-7" in record.getMessage() and record.exc_info for record in caplog.records)


def test_a_stage_failure_mid_stream_ends_the_stream_with_an_error_event():
    client, _ = _client(FakeStages(fail={"decode": _busy("decode#1", 5, 2.0)}))
    with client.stream("POST", IMAGES, json={"prompt": "a tree", "stream": True}) as r:
        events = _events("".join(r.iter_text()))
    assert [name for name, _ in events] == ["accepted", "progress", "progress", "error"]
    assert events[-1][1]["status"] == 503 and events[-1][1]["error"]["code"] == "device_busy"


@pytest.mark.parametrize("method, path", [
    ("GET", "/v1/models"), ("GET", "/v1/models/tiny-wan"), ("GET", "/v1/residency"), ("POST", IMAGES), ("POST", VIDEOS),
    ("POST", EDITS), ("GET", "/docs"),
    ("GET", "/openapi.json"), ("GET", "/redoc"), ("GET", "/no/such/route"),
])
def test_with_a_token_every_route_but_health_needs_it(method, path):
    client, _ = _client()
    error = _error(client.request(method, path, headers={"Authorization": "Bearer wrong"}), 401)
    assert error["param"] == "authorization"
    assert client.get("/health", headers={"Authorization": ""}).json()["status"] == "ok"


def test_unknown_paths_and_methods_get_openai_errors():
    client, _ = _client()
    assert _error(client.get("/v1/nothing"), 404)["code"] == "not_found"
    assert _error(client.get(IMAGES), 405)["code"] == "method_not_allowed"
    assert _error(client.delete("/v1/models"), 405)["param"] == "method"


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data",
                                          ""])
def test_json_routes_take_application_json_only(content_type):
    client, stages = _client()
    response = client.post(IMAGES, content=b'{"prompt": "a cat"}', headers={"Content-Type": content_type})
    assert _error(response, 415)["param"] == "content-type"
    assert stages.calls == []
    ok = client.post(IMAGES, content=b'{"prompt": "a cat"}', headers={"Content-Type": "application/json; charset=utf-8"})
    assert ok.status_code == 200


def test_no_cors_headers_unless_origins_are_configured():
    plain, _ = _client()
    response = plain.get("/v1/models", headers={"Origin": "https://evil.example"})
    assert not any(k.lower().startswith("access-control") for k in response.headers)
    assert plain.options(IMAGES, headers={"Origin": "https://evil.example"}).status_code in (401, 405)
    allowed, _ = _client(cors=("https://app.example",))
    ok = allowed.get("/v1/models", headers={"Origin": "https://app.example"})
    assert ok.headers["access-control-allow-origin"] == "https://app.example"
    preflight = allowed.options(IMAGES, headers={"Origin": "https://app.example",
                                                 "Access-Control-Request-Method": "POST"})
    assert preflight.status_code == 200 and "content-type" in preflight.headers["access-control-allow-headers"]
    assert _error(allowed.options(IMAGES, headers={"Origin": "https://evil.example"}), 403)["param"] == "origin"


@pytest.mark.parametrize("raw, status, code", [
    (b"[" * 5000 + b"]" * 5000, 400, "invalid_json"),
    (b'{"prompt": "a", "seed": ' + b"9" * 5000 + b"}", 400, "invalid_json"),
    (b'{"prompt": "a", "guidance_scale": 1.' + b"5" * 200 + b"}", 400, "invalid_json"),
    (b'{"prompt": "a", "guidance_scale": NaN}', 400, "invalid_json"),
    (b'{"prompt": "\xff\xfe"}', 400, "invalid_json"),
    (b'{"prompt": ', 400, "invalid_json"),
    (b'{"prompt": "' + b"a" * (1024 * 1024) + b'"}', 413, "body_too_large"),
])
def test_hostile_json_gets_a_4xx_naming_the_body(raw, status, code):
    client, stages = _client()
    error = _error(client.post(IMAGES, content=raw, headers={"Content-Type": "application/json"}), status)
    assert (error["param"], error["code"]) == ("body", code)
    assert stages.calls == []


@pytest.mark.parametrize("body, param", [
    ({"prompt": "a \ud800 cat"}, "prompt"),
    ({"prompt": "a cat", "negative_prompt": "\udfff"}, "negative_prompt"),
    ({"prompt": "a cat", "user": "\ud83d"}, "user"),
    ({"prompt": "a cat", "user": "u" * 257}, "user"),
    ({"prompt": "a cat", "size": "64x64\n"}, "size"),
    ({"prompt": "a cat", "size": "６４x６４"}, "size"),
    ({"prompt": "a cat", "size": "٦٤x٦٤"}, "size"),
    ({"prompt": "a cat", "size": ""}, "size"),
    ({"prompt": "a cat", "\ud800": 1}, "body"),  # pydantic refuses the key before naming it
])
def test_strings_that_are_not_valid_unicode_or_sizes_are_refused_naming_the_field(body, param):
    client, stages = _client()
    # ensure_ascii: the lone surrogates travel as \\u escapes, as a hostile client would send them.
    raw = json.dumps(body, ensure_ascii=True).encode()
    error = _error(client.post(IMAGES, content=raw, headers={"Content-Type": "application/json"}), 400)
    assert error["param"] == param
    assert stages.calls == []


def _scope(path: str, body: bytes) -> dict:
    return {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
            "path": path, "raw_path": path.encode(), "root_path": "", "query_string": b"",
            "server": ("test", 80), "client": ("test", 1),
            "headers": [(b"content-type", b"application/json"), (b"authorization", AUTH["Authorization"].encode()),
                        (b"x-request-id", b"leaver-1")]}


def test_a_client_leaving_an_event_stream_cancels_the_denoiser_at_the_step_it_was_on():
    async def scenario() -> tuple[FakeStages, list[bytes]]:
        stages = FakeStages(hold=asyncio.Event())  # step 2 waits: the client leaves during step 2
        api, _ = fake_api(stages)
        body = json.dumps({"prompt": "a tree", "stream": True, "num_inference_steps": 4}).encode()
        pending = [{"type": "http.request", "body": body, "more_body": False}]
        left, chunks = asyncio.Event(), []

        async def receive():
            if pending:
                return pending.pop()
            await left.wait()
            return {"type": "http.disconnect"}

        async def send(message):
            chunks.append(message.get("body", b""))
            if b"event: progress" in message.get("body", b""):
                left.set()

        await asyncio.wait_for(api(_scope(IMAGES, body), receive, send), timeout=10)
        return stages, chunks

    stages, chunks = asyncio.run(scenario())
    assert stages.cancelled == ["leaver-1"], "the denoiser kept running after its client left"
    assert stages.steps_done["leaver-1"] == 1
    assert not any(b"event: result" in chunk for chunk in chunks)
    assert ("decode", "leaver-1") not in stages.calls


class _CachingStages(FakeStages):
    """A Denoiser whose stats say how many steps it ran and how many the step cache skipped."""

    async def denoise(self, encoded, spec: GenerationSpec, progress: bool = True):
        import dataclasses

        self.threshold = spec.cache_threshold
        async for item in super().denoise(encoded, spec, progress):
            if hasattr(item, "stats"):
                item = dataclasses.replace(item, stats=dataclasses.replace(item.stats, steps=spec.steps, cache_skips=1))
            yield item


def test_the_denoise_stage_reports_its_steps_and_step_cache_skips_and_the_threshold_reaches_it():
    client, stages = _client(_CachingStages())
    response = client.post(IMAGES, json={"prompt": "a fox", "size": "32x16", "num_inference_steps": 3,
                                         "cache_threshold": 0.2})
    assert response.status_code == 200, response.text
    encode, denoise, decode = response.json()["stages"]
    assert denoise["steps"] == 3 and denoise["cache_skips"] == 1
    assert "steps" not in encode and "cache_skips" not in decode  # stages without steps say nothing of them
    assert stages.threshold == 0.2
    bad = client.post(IMAGES, json={"prompt": "a fox", "cache_threshold": 2})
    assert bad.status_code == 400 and "cache_threshold" in bad.text
