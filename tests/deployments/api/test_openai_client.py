"""The official ``openai`` client against the HTTP API over fake stages: what a user's code reads.

The client parses a streamed image's events by their ``type`` and hands the image over as the
``image_generation.completed`` event's ``b64_json``; an ``{"error": ...}`` event is an APIError.
"""
from __future__ import annotations

import base64
import io

import openai
import pytest
from fastapi.testclient import TestClient
from PIL import Image

from tests.deployments.fakes import TOKEN, FakeStages, fake_api


def _client(stages: FakeStages | None = None) -> openai.OpenAI:
    api, _ = fake_api(stages)
    return openai.OpenAI(base_url="http://testserver/v1", api_key=TOKEN, max_retries=0,
                         http_client=TestClient(api, raise_server_exceptions=False))


def _image(b64: str) -> Image.Image:
    return Image.open(io.BytesIO(base64.b64decode(b64)))


def test_a_streamed_image_arrives_as_the_completed_events_b64_json_equal_to_the_plain_answer():
    client = _client()
    plain = client.images.generate(prompt="a fox", size="32x16", n=2, extra_body={"seed": 5, "num_inference_steps": 3})
    events = list(client.images.generate(prompt="a fox", size="32x16", n=2, stream=True,
                                         extra_body={"seed": 5, "num_inference_steps": 3}))
    assert [e.type for e in events] == ["accepted", "progress", "progress", "progress",
                                        "image_generation.completed", "image_generation.completed"]
    assert [e.step for e in events if e.type == "progress"] == [1, 2, 3]
    completed = [e for e in events if e.type == "image_generation.completed"]
    assert [e.b64_json for e in completed] == [d.b64_json for d in plain.data]
    assert [(e.size, e.output_format, e.index) for e in completed] == [("32x16", "png", 0), ("32x16", "png", 1)]
    assert (plain.size, plain.output_format) == ("32x16", "png")


@pytest.mark.parametrize("output_format, pil_format", [("png", "PNG"), ("jpeg", "JPEG"), ("webp", "WEBP")])
def test_output_format_encodes_the_image_as_asked(output_format, pil_format):
    answer = _client().images.generate(prompt="a fox", size="32x16", output_format=output_format)
    image = _image(answer.data[0].b64_json)
    assert (image.format, image.size, answer.output_format) == (pil_format, (32, 16), output_format)


def test_output_compression_trades_jpeg_bytes_for_quality():
    client = _client()
    sizes = [len(base64.b64decode(client.images.generate(prompt="a fox", size="64x64", output_format="jpeg",
                                                          output_compression=level, extra_body={"seed": 1})
                                  .data[0].b64_json)) for level in (10, 100)]
    assert sizes[0] < sizes[1], sizes


def test_a_stage_failure_mid_stream_is_an_api_error_with_the_servers_message_and_code():
    client = _client(FakeStages(fail={"decode": RuntimeError("bug in decode")}))
    with pytest.raises(openai.APIError) as caught:
        list(client.images.generate(prompt="a fox", stream=True, extra_headers={"X-Request-Id": "boom-3"}))
    assert caught.value.message == "internal error in request boom-3; the server log has the details"
    assert caught.value.body["code"] == "internal_error"


@pytest.mark.parametrize("kwargs, param", [
    ({"output_format": "png", "output_compression": 50}, "output_compression"),
    ({"stream": True, "partial_images": 2}, "partial_images"),
    ({"quality": "high"}, "quality"),  # gpt-image's field: not this server's
])
def test_fields_this_server_does_not_honour_are_a_400_naming_them(kwargs, param):
    with pytest.raises(openai.BadRequestError) as caught:
        result = _client().images.generate(prompt="a fox", **kwargs)
        list(result) if kwargs.get("stream") else None
    assert caught.value.body["param"] == param, caught.value.body
