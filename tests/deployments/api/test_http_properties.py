"""Property: no request a client can send (body, headers, path, method) gets a 5xx, and every
4xx is the OpenAI error object. Hypothesis generates the requests; the stages are fakes."""
from __future__ import annotations

import json

from fastapi.testclient import TestClient
from hypothesis import strategies as st

from tests.deployments.fakes import TOKEN, fake_api
from tests.deployments.properties import status_codes_never_5xx

EXAMPLES = 600  # the issue asks for at least 500; 600 take ~20 s here
FIELDS = ["prompt", "model", "size", "seed", "num_inference_steps", "guidance_scale", "negative_prompt", "stream",
          "user", "n", "response_format", "num_frames", "fps", "output_format", "output_compression", "partial_images",
          "quality", "background", "moderation"]
PATHS = ["/v1/images/generations", "/v1/videos/generations", "/v1/models", "/v1/models/tiny-wan", "/v1/models/%2F..",
         "/v1/residency", "/health", "/docs",
         "/openapi.json", "/v1/images/generations/", "/v1/../health", "/%00", "/v1/images/generations?x=1"]

# Strings as a hostile client writes them: lone surrogates, NULs, RTL and full-width digits, newlines.
_hostile_chars = st.one_of(st.characters(), st.sampled_from(["\ud800", "\udfff", "\x00", "\n", "٦", "６", "x"]))
_text = st.text(_hostile_chars, max_size=40)
_numbers = st.one_of(st.integers(), st.floats(allow_nan=False), st.integers(min_value=-(10**60), max_value=10**60))
_scalars = st.one_of(st.none(), st.booleans(), _numbers, _text)
_json = st.recursive(_scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                         st.dictionaries(_text, inner, max_size=4)), max_leaves=12)
_plausible = st.fixed_dictionaries({"prompt": st.one_of(_text, st.just("a cat"))},
                                   optional={name: st.one_of(_json, st.just("16x16"), st.integers(0, 10),
                                                             st.sampled_from(["auto", "low", "hd", "transparent"]))
                                             for name in FIELDS if name != "prompt"})


def _raw_body(draw) -> bytes:
    kind = draw(st.sampled_from(["plausible", "any_json", "bytes", "deep", "long_number"]))
    if kind == "plausible":
        return json.dumps(draw(_plausible), ensure_ascii=True).encode()
    if kind == "any_json":
        return json.dumps(draw(_json), ensure_ascii=True).encode()
    if kind == "bytes":
        return draw(st.binary(max_size=200))
    if kind == "deep":
        depth = draw(st.integers(1, 3000))
        return draw(st.sampled_from([b"[", b'{"a":'])) * depth + b"1" + b"]" * depth
    digits = draw(st.integers(1, 6000))
    return b'{"prompt": "a", "seed": ' + b"7" * digits + b"}"


@st.composite
def requests(draw) -> dict:
    headers = {"Content-Type": draw(st.sampled_from(["application/json", "text/plain", "", "application/json; x=y",
                                                     "multipart/form-data; boundary=z", "APPLICATION/JSON"]))}
    auth = draw(st.sampled_from([f"Bearer {TOKEN}", f"Bearer {TOKEN}", "", "Bearer", "Basic abc", f"bearer {TOKEN}"]))
    if auth:
        headers["Authorization"] = auth
    if draw(st.booleans()):
        headers["X-Request-Id"] = draw(st.text(st.characters(min_codepoint=32, max_codepoint=126), max_size=80))
    method = draw(st.sampled_from(["POST", "POST", "POST", "GET", "PUT", "DELETE", "PATCH", "OPTIONS"]))
    return {"method": method, "url": draw(st.sampled_from(PATHS)), "content": _raw_body(draw), "headers": headers}


def test_no_generated_request_gets_a_5xx_and_every_error_is_the_openai_object():
    api, _ = fake_api(cors=("https://app.example",))
    client = TestClient(api, raise_server_exceptions=False)
    seen = status_codes_never_5xx(client, requests(), EXAMPLES)
    assert len(seen) >= 500
    assert any(code == 200 for code in seen), "no generated request was valid: the property tested only refusals"
