"""Starlette's private API: the path an ASGI app routes on. Runs in the HTTP ingress's process.

Kept (not rewritten from the ASGI spec) so that the API's guard and body limits match paths exactly
as Starlette's router does, ``root_path`` (Serve's route prefix) stripped the same way.
"""
from __future__ import annotations

from starlette._utils import get_route_path
from starlette.types import Scope

from compat.checked import relies_on

CHECKED = ("1.10.0", "1.10.0")


@relies_on("starlette", "starlette._utils.get_route_path", CHECKED,
           "Starlette's router strips root_path with it and exposes no public equivalent")
def route_path(scope: Scope) -> str:
    """The request's path below the app's mount point (``root_path``), as Starlette's router matches it."""
    return get_route_path(scope)
