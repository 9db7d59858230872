"""``POST /v1/images/variations`` (deployments/api/images/variations.py): the official client's
``images.create_variation`` gets a 400 naming ``model`` that points to edits, never a bare 404 or a 5xx,
and nothing reaches a stage; without the token it is a 401 as every route is."""
from __future__ import annotations

import openai
import pytest

from tests.deployments.api.images.test_edits import _client, png


def test_the_clients_create_variation_is_a_400_naming_model_that_points_to_edits():
    client, stages = _client()
    with pytest.raises(openai.BadRequestError) as refused:
        client.images.create_variation(image=("in.png", png(32, 32), "image/png"), n=2, size="256x256")
    body = refused.value.body
    assert (body["param"], body["code"]) == ("model", "invalid_value"), body
    assert "not served" in body["message"] and "POST /v1/images/edits" in body["message"]
    assert not stages.calls, "nothing reached a stage"


def test_without_the_token_a_variation_is_a_401_as_every_route():
    client, _ = _client()
    with pytest.raises(openai.AuthenticationError):
        client.with_options(api_key="wrong").images.create_variation(image=("in.png", png(32, 32), "image/png"))
