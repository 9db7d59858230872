"""The ASGI guard in front of every route: request id, bearer token, Content-Type, CORS.

It runs before FastAPI routes anything, so it also covers ``/docs``, ``/openapi.json``,
``/redoc`` and unknown paths (with a token configured, only ``/health`` answers without it), and
its refusals are the same OpenAI error objects as the routes' own.
"""
from __future__ import annotations

import hmac
import re
import uuid
from dataclasses import dataclass

from fastapi.responses import JSONResponse
from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Receive, Scope, Send

from compat.starlette import route_path
from deployments.api import errors

# Serve's proxy puts its request id in this header (and in the response); we reuse it so the id
# in our logs and error bodies is the one Serve logs. A client-chosen id is used only if it is a
# short plain token: it lands in log lines.
REQUEST_ID_HEADER = b"x-request-id"
_SAFE_ID = re.compile(r"[A-Za-z0-9._-]{1,64}")
OPEN_PATHS = frozenset({"/health"})  # load balancers probe it without credentials
JSON_TYPES = ("application/json",)


@dataclass(frozen=True)
class GuardConfig:
    api_token: str | None  # None: no auth; else every route but OPEN_PATHS needs "Bearer <token>"
    # Origins allowed to call from a browser; empty: no CORS headers at all (browsers then refuse
    # cross-origin calls, and a JSON body needs a preflight, which gets no allow headers).
    cors_origins: tuple[str, ...] = ()
    # POST routes that take a JSON body; other content types get 415. Per route so that routes
    # taking multipart uploads can name their own types.
    body_types: tuple[tuple[str, tuple[str, ...]], ...] = ()


def request_id(scope: Scope) -> str:
    """The request's id (Serve's, when sane), also stored in ``scope["state"]["request_id"]``."""
    state = scope.setdefault("state", {})
    if "request_id" not in state:
        given = dict(scope.get("headers") or ()).get(REQUEST_ID_HEADER, b"").decode("latin-1")
        state["request_id"] = given if _SAFE_ID.fullmatch(given) else uuid.uuid4().hex
    return state["request_id"]


def _header(scope: Scope, name: bytes) -> str:
    for key, value in scope.get("headers") or ():
        if key == name:
            return value.decode("latin-1")
    return ""


def _media_type(value: str) -> str:
    return value.split(";", 1)[0].strip().lower()


class Guard:
    """Pure ASGI middleware (no BaseHTTPMiddleware: it would break SSE cancellation)."""

    def __init__(self, app: ASGIApp, config: GuardConfig):
        self.app, self.config = app, config
        # Starlette's CORS answers an allowed origin's preflight and marks the responses it may read;
        # this guard only refuses an unknown origin's preflight first (an OpenAI error, not a plain 400).
        self.inner = app if not config.cors_origins else CORSMiddleware(
            app, allow_origins=config.cors_origins, allow_methods=("GET", "POST", "DELETE"),
            allow_headers=("authorization", "content-type"), max_age=600)
        self.body_types = dict(config.body_types)
        self.token = None if config.api_token is None else f"Bearer {config.api_token}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rid = request_id(scope)
        refusal = self._refusal(scope)
        if refusal is not None:
            refusal.headers["X-Request-Id"] = rid
            await refusal(scope, receive, send)
            return
        await self.inner(scope, receive, self._decorate(scope, send))

    def _refusal(self, scope: Scope) -> JSONResponse | None:
        # The path below the application's route prefix (Serve mounts the app at its route_prefix).
        path, method = route_path(scope), scope.get("method", "GET")
        if method == "OPTIONS" and self.config.cors_origins and _header(scope, b"origin"):
            if not self._origin_allowed(scope):
                return errors.error_json(403, "origin not allowed", "origin", "cors_origin_refused",
                                         "invalid_request_error")
            if _header(scope, b"access-control-request-method"):
                return None  # a browser's preflight carries no credentials: Starlette's CORS answers it
        if self.token is not None and path not in OPEN_PATHS:
            given = _header(scope, b"authorization").encode("latin-1")
            if not hmac.compare_digest(given, self.token):
                return errors.error_json(401, "missing or wrong bearer token", "authorization",
                                         "invalid_api_key", "authentication_error", {"WWW-Authenticate": "Bearer"})
        allowed = self.body_types.get(path)
        if method == "POST" and allowed is not None:
            given_type = _media_type(_header(scope, b"content-type"))
            if given_type not in allowed:
                return errors.error_json(415, f"Content-Type {given_type or '(none)'!r} is not accepted here; "
                                              f"send {' or '.join(allowed)}", "content-type",
                                         "unsupported_media_type", "invalid_request_error")
        return None

    def _origin_allowed(self, scope: Scope) -> bool:
        return "*" in self.config.cors_origins or _header(scope, b"origin") in self.config.cors_origins

    def _decorate(self, scope: Scope, send: Send) -> Send:
        rid = request_id(scope)

        async def decorated(message):
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != REQUEST_ID_HEADER]
                headers.append((REQUEST_ID_HEADER, rid.encode()))
                message = {**message, "headers": headers}
            await send(message)

        return decorated
