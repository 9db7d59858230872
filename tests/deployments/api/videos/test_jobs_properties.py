"""Property: no request to the Videos API (JSON or multipart body, query, id, method) gets a 5xx,
and every 4xx is the OpenAI error object. Hypothesis generates them; the runner drives fakes."""
from __future__ import annotations

import dataclasses
import json

from fastapi.testclient import TestClient
from hypothesis import strategies as st

from deployments.api.routes import build_api
from deployments.api.videos import jobs as video_jobs
from deployments.jobs.queue import InProcessJobQueue, JobQueueService
from tests.deployments.api.test_http_properties import _json, _text
from tests.deployments.fakes import FakeBoard, FakeStages, fake_config
from tests.deployments.properties import status_codes_never_5xx
from tests.deployments.video_fakes import LIMITS, FakePipeline, jobs_args

EXAMPLES = 300  # ~10 s here
FIELDS = ["prompt", "model", "seconds", "size", "input_reference", "user", "seed", "num_inference_steps",
          "guidance_scale", "negative_prompt", "fps", "n", "stream"]
IDS = ["video_0665172898800010592da7e0", "video_", "..", "video_0665172898800010592da7e0x", "%00", "x" * 300]
# A query string is bytes on the wire: a lone surrogate cannot be sent (its UTF-8 bytes arrive as U+FFFD).
_query_text = st.text(st.characters(blacklist_categories=("Cs",)), max_size=40)
_values = st.one_of(_json, st.sampled_from(["1", "2", "16x16", "64x64", "0.5", "12", "a cat", ""]),
                    st.integers(-5, 300))
_bodies = st.fixed_dictionaries({"prompt": st.one_of(_text, st.just("a cat"))},
                                optional={name: _values for name in FIELDS if name != "prompt"})
EDIT_FIELDS = ["model", "seconds", "size", "strength", "seed", "num_inference_steps", "guidance_scale", "lora",
               "negative_prompt", "video", "video[id]"]
_edit_bodies = st.fixed_dictionaries(
    {"prompt": st.one_of(_text, st.just("a cat"))},
    optional={name: st.one_of(_values, st.fixed_dictionaries({"id": st.sampled_from(IDS)})) for name in EDIT_FIELDS})


def _clip() -> bytes:
    import torch

    from deployments.wire import media

    return media.mp4_bytes(torch.rand(7, 32, 48, 3, generator=torch.Generator().manual_seed(0)), 8)


CLIP = _clip()


@st.composite
def uploads(draw) -> bytes:
    """A real clip, cut short, with bytes changed anywhere (its boxes or its frames), or not a video at all."""
    clip = bytearray(CLIP)
    kind = draw(st.sampled_from(["whole", "cut", "flipped", "flipped", "noise"]))
    if kind == "cut":
        return bytes(clip[:draw(st.integers(0, len(clip)))])
    if kind == "flipped":
        for at in draw(st.lists(st.integers(0, len(clip) - 1), min_size=1, max_size=8)):
            clip[at] = draw(st.integers(0, 255))
    if kind == "noise":
        return draw(st.binary(max_size=2000))
    return bytes(clip)


@st.composite
def requests(draw) -> dict:
    video_id = draw(st.sampled_from(IDS))
    kind = draw(st.sampled_from(["create_json", "create_json", "create_form", "retrieve", "content", "list",
                                 "delete", "other_method", "remix", "edit_json", "edit_upload", "extend_upload"]))
    if kind in ("remix", "edit_json"):
        url = f"/v1/videos/{video_id}/remix" if kind == "remix" else "/v1/videos/edits"
        return {"method": "POST", "url": url, "content": json.dumps(draw(_edit_bodies)).encode(),
                "headers": {"Content-Type": "application/json"}}
    if kind in ("edit_upload", "extend_upload"):
        fields = {k: v if isinstance(v, str) else json.dumps(v) for k, v in draw(_edit_bodies).items() if k != "video"}
        fields = {k: (None, v.encode("utf-8", "surrogatepass").decode("utf-8", "replace")) for k, v in fields.items()}
        url = "/v1/videos/edits" if kind == "edit_upload" else "/v1/videos/extensions"
        return {"method": "POST", "url": url, "files": {**fields, "video": ("clip.mp4", draw(uploads()), "video/mp4")}}
    if kind == "create_json":
        return {"method": "POST", "url": "/v1/videos", "content": json.dumps(draw(_bodies)).encode(),
                "headers": {"Content-Type": draw(st.sampled_from(["application/json", "text/plain", ""]))}}
    if kind == "create_form":
        fields = {k: v if isinstance(v, str) else json.dumps(v) for k, v in draw(_bodies).items()}
        fields = {k: v.encode("utf-8", "surrogatepass").decode("utf-8", "replace") for k, v in fields.items()}
        return {"method": "POST", "url": "/v1/videos", "files": {k: (None, v) for k, v in fields.items()}}
    if kind == "list":
        query = draw(st.dictionaries(st.sampled_from(["after", "limit", "order"]),
                                     st.one_of(st.sampled_from(["asc", "desc", "0", "20", "101", IDS[0]]), _query_text),
                                     max_size=3))
        return {"method": "GET", "url": "/v1/videos", "params": query}
    if kind == "content":
        variant = draw(st.one_of(st.sampled_from(["video", "thumbnail", "spritesheet"]), _query_text))
        return {"method": "GET", "url": f"/v1/videos/{video_id}/content", "params": {"variant": variant}}
    method = {"retrieve": "GET", "delete": "DELETE"}.get(kind) or draw(st.sampled_from(["PUT", "PATCH"]))
    return {"method": method, "url": f"/v1/videos/{video_id}"}


def test_no_generated_videos_request_gets_a_5xx_and_every_error_is_the_openai_object(tmp_path):
    args = jobs_args(tmp_path)
    service = JobQueueService("test-app", args)
    backend = video_jobs.JobsBackend(InProcessJobQueue(service), service.results, "prop-runner", FakePipeline())
    config = dataclasses.replace(fake_config(None), limits=LIMITS, jobs=args)
    api = build_api(config, FakeStages(), FakeBoard(), backend)
    with TestClient(api, raise_server_exceptions=False) as client:  # one loop: the runner lives in it
        try:
            seen = status_codes_never_5xx(client, requests(), EXAMPLES)
        finally:
            client.portal.call(api.state.video_jobs.runner.stop)
            service.close()
    assert len(seen) >= EXAMPLES
    assert any(code == 200 for code in seen), "no generated request was valid: the property tested only refusals"
