"""The official ``openai`` client against the HTTP API over fake stages: what a user's code reads.

The client parses a streamed image's events by their ``type`` and hands the image over as the
``image_generation.completed`` event's ``b64_json``; an ``{"error": ...}`` event is an APIError.
"""
from __future__ import annotations

import base64
import io
import pathlib
import re

import openai
import pytest
from fastapi.testclient import TestClient
from PIL import Image

from tests.deployments.fakes import TOKEN, FakeStages, fake_api

README = pathlib.Path(__file__).resolve().parents[3] / "README.md"


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


def test_partial_images_stream_previews_spread_before_the_last_step_then_the_image():
    client = _client()
    events = list(client.images.generate(prompt="a fox", size="32x16", n=2, stream=True, partial_images=2,
                                         output_format="jpeg", extra_body={"seed": 5, "num_inference_steps": 6}))
    partial = [e for e in events if e.type == "image_generation.partial_image"]
    # After steps 2 and 4 of 6 (each preview before the progress event that follows its step).
    assert [(e.partial_image_index, e.index, e.step) for e in partial] == [(0, 0, 2), (0, 1, 2), (1, 0, 4), (1, 1, 4)]
    types = [e.type for e in events]
    assert types.index("image_generation.partial_image") == types.index("progress") + 2
    assert types[-2:] == ["image_generation.completed"] * 2
    # The fake decoder dims a preview by the steps left: each is its own image, and a JPEG as asked.
    assert [_image(e.b64_json).format for e in partial] == ["JPEG"] * 4
    assert len({e.b64_json for e in partial if e.index == 0} | {events[-2].b64_json}) == 3


def test_more_partial_images_than_steps_before_the_last_sends_fewer():
    events = list(_client().images.generate(prompt="a fox", stream=True, partial_images=3,
                                            extra_body={"num_inference_steps": 2}))
    assert [e.step for e in events if e.type == "image_generation.partial_image"] == [1]


def test_a_preview_that_fails_is_not_sent_and_the_image_still_is(caplog):
    client = _client(FakeStages(fail={"preview": RuntimeError("preview decode broke")}))
    with caplog.at_level("WARNING", logger="deployments.api.service"):
        events = list(client.images.generate(prompt="a fox", stream=True, partial_images=1,
                                             extra_body={"num_inference_steps": 2}))
    assert [e.type for e in events] == ["accepted", "progress", "progress", "image_generation.completed"]
    assert any("preview 0 (after step 1 of 2) not sent" in r.getMessage() and "preview decode broke" in r.getMessage()
               for r in caplog.records)


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
    ({"partial_images": 2}, "partial_images"),  # previews are events: without stream there are none
    ({"background": "transparent"}, "background"),  # these models make opaque images
    ({"style": "vivid"}, "style"),  # DALL·E 3's: nothing here it could change
])
def test_fields_this_server_does_not_honour_are_a_400_naming_them(kwargs, param):
    with pytest.raises(openai.BadRequestError) as caught:
        extra = {"extra_body": {"style": kwargs.pop("style")}} if "style" in kwargs else {}
        result = _client().images.generate(prompt="a fox", **kwargs, **extra)
        list(result) if kwargs.get("stream") else None
    assert caught.value.body["param"] == param, caught.value.body


def test_models_retrieve_gives_the_served_models_card_and_any_other_id_is_model_not_found():
    client = _client()
    listed = client.models.list().data
    card = client.models.retrieve(listed[0].id)
    assert card.model_dump() == listed[0].model_dump() and card.id == "tiny-wan" and card.family == "wan"
    with pytest.raises(openai.NotFoundError) as caught:
        client.models.retrieve("Wan-AI/Wan2.1-T2V-14B")  # an id with a '/' reaches the route too
    assert caught.value.body["code"] == "model_not_found" and "tiny-wan" in caught.value.message


def test_the_readmes_image_examples_run_as_printed_and_the_stream_ends_with_the_plain_image(tmp_path, monkeypatch,
                                                                                            capsys):
    section = README.read_text().split("### An image", 1)[1].split("\n### ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    assert len(blocks) == 2, "the plain example and the streamed one"
    made = _client()
    monkeypatch.setattr(openai, "OpenAI", lambda **kwargs: made)  # the README's base_url: the fake API
    monkeypatch.chdir(tmp_path)
    exec(compile(blocks[0], str(README), "exec"), namespace := {"__name__": "readme_image"})
    plain = (tmp_path / "fox.png").read_bytes()
    exec(compile(blocks[1], str(README), "exec"), namespace)
    assert (tmp_path / "fox.png").read_bytes() == plain, "the stream's image is the plain answer's"
    previews = [(tmp_path / f"fox-{i}.png").read_bytes() for i in (0, 1)]
    assert len({plain, *previews}) == 3 and all(_image(base64.b64encode(p)).size == (64, 64) for p in previews)
    assert capsys.readouterr().out.splitlines() == [f"step {k} of 8" for k in range(1, 9)]


def test_gpt_image_clients_defaults_are_taken_and_quality_low_runs_fewer_steps():
    # What gpt-image clients send by default (quality, background and moderation "auto") is a 200 with the
    # deployment's default steps (2 here); "low" is half of them; an explicit num_inference_steps wins.
    stages = FakeStages()
    client = _client(stages)
    client.images.generate(prompt="a fox", quality="auto", background="auto", moderation="auto", output_format="png")
    client.images.generate(prompt="a fox", quality="low", background="opaque", moderation="low")
    client.images.generate(prompt="a fox", quality="low", extra_body={"num_inference_steps": 3})
    assert [spec.steps for spec in stages.specs.values()] == [2, 1, 3]
    card = client.models.retrieve("tiny-wan")
    assert card.model_extra["quality_steps"] == {"auto": 2, "low": 1, "medium": 2, "high": 2, "standard": 2, "hd": 2}
