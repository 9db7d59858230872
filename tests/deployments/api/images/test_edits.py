"""``POST /v1/images/edits`` with the official ``openai`` client, over fake stages validating as tiny FLUX.1.

What reaches the stages (the image, its size, the strength and the steps it runs) and every refusal,
named; the stages' own edit is pinned bitwise in tests/deployments/models/test_edits.py.
"""
from __future__ import annotations

import base64
import io
import pathlib
import re

import openai
import pytest
from fastapi.testclient import TestClient
from hypothesis import strategies as st
from openai.types import ImageEditCompletedEvent, ImageEditPartialImageEvent
from PIL import Image

from deployments.wire.spec import EditRule
from tests.deployments.fakes import TOKEN, FakeStages, fake_api
from tests.deployments.properties import status_codes_never_5xx
from zoo import tiny, tiny_families, wan22

EXTRAS = {"seed": 4, "num_inference_steps": 4}


def _client(folder=tiny.ensure_tiny_flux) -> tuple[openai.OpenAI, FakeStages]:
    api, stages = fake_api(folder=folder)
    client = openai.OpenAI(base_url="http://testserver/v1", api_key=TOKEN, max_retries=0,
                           http_client=TestClient(api, raise_server_exceptions=False))
    return client, stages


def png(width: int = 40, height: int = 24, exif_orientation: int | None = None) -> bytes:
    out = io.BytesIO()
    image = Image.new("RGB", (width, height), (10, 200, 30))
    exif = Image.Exif()
    if exif_orientation is not None:
        exif[0x0112] = exif_orientation
    image.save(out, format="PNG", exif=exif)
    return out.getvalue()


def rgba_mask(width: int = 40, height: int = 24) -> bytes:
    """OpenAI's mask: opaque, with a transparent square where the edit may repaint."""
    out = io.BytesIO()
    mask = Image.new("RGBA", (width, height), (0, 0, 0, 255))
    mask.paste((0, 0, 0, 0), (4, 4, 12, 12))
    mask.save(out, format="PNG")
    return out.getvalue()


def _spec(stages: FakeStages):
    (spec,) = stages.specs.values()
    return spec


def test_an_edit_sends_the_image_at_its_own_size_with_the_strength_and_runs_that_share_of_the_steps():
    client, stages = _client()
    answer = client.images.edit(image=("in.png", png(), "image/png"), prompt="a fox",
                                extra_body={**EXTRAS, "strength": 0.5})
    spec = _spec(stages)
    assert (spec.width, spec.height, spec.strength, spec.reference_image) == (40, 24, 0.5, png())
    assert (spec.steps, spec.run_steps) == (4, 2)  # the schedule of 4, entered at its step 2
    assert answer.size == "40x24" and Image.open(io.BytesIO(base64.b64decode(answer.data[0].b64_json))).size == (40, 24)


def test_auto_size_is_the_upright_image_rounded_down_to_the_models_multiple_and_size_resizes_it():
    client, stages = _client()
    client.images.edit(image=("in.png", png(45, 30, exif_orientation=6), "image/png"), prompt="a fox", size="auto",
                       extra_body=EXTRAS)
    assert (_spec(stages).width, _spec(stages).height) == (28, 44)  # stored 45x30, turned a quarter: 30x45, to 4s
    stages.specs.clear()
    client.images.edit(image=("in.png", png(), "image/png"), prompt="a fox", size="32x32", extra_body=EXTRAS)
    assert (_spec(stages).width, _spec(stages).height, _spec(stages).strength) == (32, 32, 0.6)  # the default


def test_a_streamed_edit_is_openais_edit_events_counting_its_own_steps_and_ending_with_the_plain_answer():
    client, stages = _client()
    extras = {"seed": 4, "num_inference_steps": 8, "strength": 0.5}
    plain = client.images.edit(image=("in.png", png(), "image/png"), prompt="a fox", extra_body=extras)
    events = list(client.images.edit(image=("in.png", png(), "image/png"), prompt="a fox", stream=True,
                                     partial_images=1, extra_body=extras))
    assert events[0].type == "accepted" and events[0].model_extra["total_steps"] == 4
    assert [e.step for e in events if e.type == "progress"] == [1, 2, 3, 4]
    (preview,) = [e for e in events if e.type == "image_edit.partial_image"]
    assert isinstance(preview, ImageEditPartialImageEvent) and preview.model_extra["step"] == 2
    assert isinstance(events[-1], ImageEditCompletedEvent) and events[-1].type == "image_edit.completed"
    assert events[-1].b64_json == plain.data[0].b64_json != preview.b64_json


def test_the_list_form_of_image_and_a_json_data_url_are_edits_too():
    client, stages = _client()
    client.images.edit(image=[("in.png", png(), "image/png")], prompt="a fox", extra_body=EXTRAS)
    assert _spec(stages).reference_image == png()
    stages.specs.clear()
    url = "data:image/png;base64," + base64.b64encode(png()).decode()
    answer = client.post("/images/edits", cast_to=object, body={"prompt": "a fox", "image": url, **EXTRAS})
    assert answer["size"] == "40x24" and _spec(stages).reference_image == png()


@pytest.mark.parametrize("kwargs, param, words", [
    ({"mask": ("m.png", png(), "image/png")}, "mask", "has no alpha channel"),
    ({"mask": ("m.png", rgba_mask(32, 24), "image/png")}, "mask", "is 32x24, the image 40x24"),
    ({"mask": ("m.png", b"not an image", "image/png")}, "mask", "not an image"),
    ({"extra_body": {"strength": 0}}, "strength", "greater than 0"),
    ({"extra_body": {"strength": 1.5}}, "strength", "less than or equal to 1"),
    ({"image": ("in.txt", b"not an image", "text/plain")}, "image", "not an image"),
    ({"image": ("big.png", png(200, 24), "image/png")}, "image", "pass 'size' to resize it"),
    ({"image": ("tiny.png", png(3, 3), "image/png")}, "image", "pass 'size' to resize it"),
    ({"extra_body": {"input_fidelity": "high"}}, "input_fidelity", "Extra inputs are not permitted"),
    ({"extra_body": {"background": "transparent"}}, "background", "opaque (RGB) images"),
    ({"size": "33x32"}, "size", "positive multiples of 4"),
])
def test_what_an_edit_cannot_do_is_a_400_naming_the_field(kwargs, param, words):
    client, stages = _client()
    kwargs = {"image": ("in.png", png(), "image/png"), **kwargs}
    with pytest.raises(openai.BadRequestError) as refused:
        client.images.edit(prompt="a fox", **kwargs)
    assert refused.value.body["param"] == param and words in refused.value.body["message"], refused.value.body
    assert not stages.calls, "nothing reached a stage"


def test_a_mask_reaches_the_stages_on_a_family_that_inpaints_and_is_refused_by_name_on_one_that_does_not():
    client, stages = _client()
    client.images.edit(image=("in.png", png(), "image/png"), mask=("m.png", rgba_mask(), "image/png"), prompt="a fox",
                       extra_body=EXTRAS)
    assert (_spec(stages).mask_image, _spec(stages).reference_image) == (rgba_mask(), png())
    wan, stages = _client(tiny.ensure_tiny_wan)  # WanVideoToVideoPipeline edits; diffusers has no Wan inpainting
    with pytest.raises(openai.BadRequestError) as refused:
        wan.images.edit(image=("in.png", png(), "image/png"), mask=("m.png", rgba_mask(), "image/png"), prompt="a fox")
    assert refused.value.body["param"] == "mask" and "not supported by the wan model family" in refused.value.body["message"]
    assert not stages.calls


def test_two_images_are_refused_not_one_of_them_taken_silently():
    client, stages = _client()
    images = [("a.png", png(), "image/png"), ("b.png", png(32, 32), "image/png")]  # sent as image[] twice
    with pytest.raises(openai.BadRequestError) as refused:
        client.images.edit(image=images, prompt="a fox", extra_body=EXTRAS)
    assert refused.value.body["param"] == "image" and "one image at a time" in refused.value.body["message"]
    assert not stages.calls


def test_a_family_that_composes_images_takes_up_to_its_max_in_order_and_refuses_more_by_name():
    client, stages = _client(tiny_families.ensure_tiny_qwen_image_edit)  # Qwen-Image-Edit-2509: up to 3
    images = [("a.png", png(), "image/png"), ("b.png", png(32, 32), "image/png"), ("c.png", png(16, 48), "image/png")]
    client.images.edit(image=images, prompt="the fox of picture 1 on picture 2", extra_body=EXTRAS)
    spec = _spec(stages)
    assert (spec.reference_image, spec.context_images) == (png(), (png(32, 32), png(16, 48)))
    assert (spec.width, spec.height) == (32, 16), "size auto: the first image's, rounded down to the multiple"
    stages.specs.clear()
    urls = ["data:image/png;base64," + base64.b64encode(png(w, h)).decode() for w, h in ((40, 24), (32, 32))]
    client.post("/images/edits", cast_to=object, body={"prompt": "a fox", "image": urls, **EXTRAS})  # JSON's list
    assert _spec(stages).context_images == (png(32, 32),)
    for body, words in (({"image": images + [("d.png", png(), "image/png")]}, "at most 3 images"),
                        ({"image": [("a.png", png(), "image/png"), ("thin.png", png(40, 8), "image/png")]},
                         "at least 16 px")):
        client, stages = _client(tiny_families.ensure_tiny_qwen_image_edit)
        with pytest.raises(openai.BadRequestError) as refused:
            client.images.edit(prompt="a fox", extra_body=EXTRAS, **body)
        assert refused.value.body["param"] == "image" and words in refused.value.body["message"], refused.value.body
        assert not stages.calls
    with pytest.raises(openai.BadRequestError) as refused:
        client.post("/images/edits", cast_to=object, body={"prompt": "a fox", "image": [], **EXTRAS})
    assert refused.value.body["param"] == "image" and "required" in refused.value.body["message"]


def test_an_edit_without_an_image_and_a_family_that_cannot_edit_are_refused_by_name():
    client, _ = _client()
    with pytest.raises(openai.BadRequestError) as refused:
        client.post("/images/edits", cast_to=object, body={"prompt": "a fox"})
    assert refused.value.body["param"] == "image" and "required" in refused.value.body["message"]
    a14b, stages = _client(wan22.ensure_tiny_wan22_a14b)  # two experts: WanVideoToVideoPipeline runs one
    with pytest.raises(openai.BadRequestError) as refused:
        a14b.images.edit(image=("in.png", png(), "image/png"), prompt="a fox")
    assert refused.value.body["param"] == "model" and "does not edit images" in refused.value.body["message"]
    assert not stages.calls


def test_wan_enters_its_schedule_its_own_way_and_a_strength_that_runs_no_step_is_refused():
    client, stages = _client(tiny.ensure_tiny_wan)
    client.images.edit(image=("in.png", png(48, 32), "image/png"), prompt="a fox",
                       extra_body={**EXTRAS, "num_inference_steps": 8, "strength": 0.6})
    assert (_spec(stages).edit_rule, _spec(stages).run_steps) == (EditRule.VIDEO2VIDEO, 4)  # 8 - int(4.8)
    with pytest.raises(openai.BadRequestError) as refused:
        client.images.edit(image=("in.png", png(48, 32), "image/png"), prompt="a fox",
                           extra_body={**EXTRAS, "strength": 0.2})  # int(4 x 0.2) = 0 steps
    assert refused.value.body["param"] == "strength" and "runs no denoising step" in refused.value.body["message"]


def test_the_readmes_edit_example_runs_as_printed_on_the_image_and_client_of_its_first_block(tmp_path, monkeypatch):
    readme = pathlib.Path(__file__).resolve().parents[4] / "README.md"
    text = readme.read_text()
    first = re.findall(r"```python\n(.*?)```", text.split("### An image", 1)[1], flags=re.S)[0]
    (block,) = re.findall(r"```python\n(.*?)```", text.split("### An edit", 1)[1].split("\n### ", 1)[0], flags=re.S)
    client, stages = _client(tiny.ensure_tiny_wan)  # the quickstart's model
    monkeypatch.setattr(openai, "OpenAI", lambda **kwargs: client)  # the README's base_url: the fake API
    monkeypatch.chdir(tmp_path)
    exec(compile(first, str(readme), "exec"), namespace := {"__name__": "readme_image"})
    stages.specs.clear()
    exec(compile(block, str(readme), "exec"), namespace)
    assert Image.open(tmp_path / "fox-snow.png").size == (64, 64)
    spec = _spec(stages)  # "4 of 8 here": Wan enters its schedule at 8 - int(8 x 0.6)
    assert (spec.reference_image, spec.strength, spec.steps, spec.run_steps) == \
        ((tmp_path / "fox.png").read_bytes(), 0.6, 8, 4)


EDIT_FIELDS = ["prompt", "size", "seed", "num_inference_steps", "strength", "n", "stream", "partial_images",
               "output_format", "guidance_scale", "mask", "model"]


@st.composite
def edit_requests(draw) -> dict:
    """Edits as a hostile or careless client sends them: forms with any image bytes (a PNG of any size,
    garbage, nothing) and any field values, JSON with any data URL."""
    image = draw(st.one_of(st.just(png()), st.builds(png, st.integers(1, 300), st.integers(1, 300)),
                           st.binary(max_size=64), st.just(b"")))
    fields = draw(st.dictionaries(st.sampled_from(EDIT_FIELDS),
                                  st.one_of(st.text(max_size=12), st.integers(-5, 40).map(str),
                                            st.sampled_from(["0.5", "1", "0", "1e9", "nan", "auto", "16x16", "true"])),
                                  max_size=6))
    fields.setdefault("prompt", "a fox")
    if draw(st.booleans()):
        name = draw(st.sampled_from(["image", "image[]", "mask", "other"]))
        return {"method": "POST", "url": "/v1/images/edits", "data": fields,
                "files": {name: ("in.png", image, "image/png")}, "headers": {"Authorization": f"Bearer {TOKEN}"}}
    fields["image"] = draw(st.one_of(st.just("data:image/png;base64," + base64.b64encode(image).decode()),
                                     st.text(max_size=20), st.integers()))
    return {"method": "POST", "url": "/v1/images/edits", "json": fields,
            "headers": {"Authorization": f"Bearer {TOKEN}"}}


def test_no_generated_edit_gets_a_5xx_and_every_error_is_the_openai_object():
    api, _ = fake_api(folder=tiny.ensure_tiny_flux)
    seen = status_codes_never_5xx(TestClient(api, raise_server_exceptions=False), edit_requests(), 200)
    assert any(code == 200 for code in seen) and any(code == 400 for code in seen), sorted(set(seen))


def test_an_in_context_edit_sends_the_image_without_a_strength_and_a_strength_or_mask_is_refused_by_name():
    client, stages = _client(tiny.ensure_tiny_flux_kontext)  # FLUX.1 Kontext: every step runs, nothing noised
    client.images.edit(image=("in.png", png(), "image/png"), prompt="make it snowy", extra_body=EXTRAS)
    spec = _spec(stages)
    assert (spec.reference_image, spec.strength, spec.edit_rule) == (png(), None, EditRule.IN_CONTEXT)
    assert (spec.width, spec.height, spec.run_steps, spec.guidance_scale) == (32, 16, 4, 2.5)
    with pytest.raises(openai.BadRequestError) as refused:  # the pipeline fits it by its aspect: 0 px across
        client.images.edit(image=("thin.png", png(40, 8), "image/png"), prompt="a fox", size="32x16", extra_body=EXTRAS)
    assert refused.value.body["param"] == "image" and "at least 16 px" in refused.value.body["message"]
    for extra, param in (({"strength": 0.5}, "strength"), ({}, "mask")):
        client, stages = _client(tiny.ensure_tiny_flux_kontext)
        mask = {"mask": ("m.png", rgba_mask(), "image/png")} if param == "mask" else {}
        with pytest.raises(openai.BadRequestError) as refused:
            client.images.edit(image=("in.png", png(), "image/png"), prompt="a fox", extra_body={**EXTRAS, **extra},
                               **mask)
        assert refused.value.body["param"] == param, refused.value.body
        assert not stages.calls


def test_an_edit_only_family_edits_in_context_and_refuses_a_generation_by_name():
    client, stages = _client(tiny_families.ensure_tiny_qwen_image_edit)  # Qwen-Image-Edit: its pipelines need an image
    client.images.edit(image=("in.png", png(), "image/png"), prompt="make it snowy", extra_body=EXTRAS)
    spec = _spec(stages)
    assert (spec.reference_image, spec.strength, spec.edit_rule) == (png(), None, EditRule.IN_CONTEXT)
    assert (spec.width, spec.height, spec.run_steps, spec.guidance_scale) == (32, 16, 4, 4.0)
    client, stages = _client(tiny_families.ensure_tiny_qwen_image_edit)
    with pytest.raises(openai.BadRequestError) as refused:
        client.images.generate(prompt="a fox", extra_body=EXTRAS)
    assert refused.value.body["param"] == "model" and "/v1/images/edits" in refused.value.body["message"]
    assert not stages.calls
