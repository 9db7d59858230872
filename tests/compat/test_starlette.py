"""Starlette's route path, as the API's guard and body limits read it (compat/starlette.py)."""
from __future__ import annotations

import pytest
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from compat.checked import REGISTRY
from compat.starlette import route_path

USE = REGISTRY["compat.starlette.route_path"]


@pytest.mark.parametrize("scope, expected", [
    ({"path": "/v1/videos"}, "/v1/videos"),
    ({"path": "/app/v1/videos", "root_path": "/app"}, "/v1/videos"),
    ({"path": "/app", "root_path": "/app"}, ""),
    ({"path": "/application/x", "root_path": "/app"}, "/application/x"),  # a prefix of a segment is not a mount
    ({"path": "/other/x", "root_path": "/app"}, "/other/x"),
])
def test_route_path_strips_the_mount_point_only(scope, expected):
    assert route_path(scope) == expected, USE.mismatch(f"returned {route_path(scope)!r} for {scope}")


def test_route_path_is_what_starlettes_router_matches():
    seen = []

    async def echo(request):
        seen.append(route_path(request.scope))
        return PlainTextResponse("ok")

    app = Starlette(routes=[Route("/v1/x", echo)])
    response = TestClient(app, root_path="/app").get("/app/v1/x")
    assert response.status_code == 200 and seen == ["/v1/x"], USE.mismatch(f"disagrees with the router: {seen}")
