"""Whether the application can serve: every stage deployment it needs has a running replica.

The ingress's watch (``deployments.ingress.watch``) reads Serve's status of the stages every
couple of seconds and hands the API a :class:`ServingState`; the API answers from it, never from a
guess: ``GET /health`` is a 503 naming the stage and Serve's reason while one is down, ``GET
/v1/models`` says the model is not serving, and ``POST`` of a generation or a video job is a 503
with ``Retry-After`` at once (:class:`NotServingGate`), instead of a request that waits on a
deployment that is not there (an image request used to hang past 60 s; a video job was queued for
nothing to run). No Ray here: the API reaches it through ``seams.ServingCheck``.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from compat.starlette import route_path
from deployments.api import errors


@dataclass(frozen=True)
class StageDown:
    """A stage deployment with no running replica, as Serve describes it."""

    deployment: str  # TextEncoder, Denoiser, VaeDecoder
    status: str  # Serve's DeploymentStatus: UPDATING (deploying), UNHEALTHY, DEPLOY_FAILED, or MISSING
    reason: str  # Serve's message for it ("" before Serve has one)

    def describe(self) -> str:
        state = {"UPDATING": "deploying", "DEPLOY_FAILED": "failed to deploy", "UNHEALTHY": "unhealthy",
                 "MISSING": "not in the application"}.get(self.status, self.status.lower())
        return f"stage {self.deployment} is not running ({state}" + (f": {self.reason})" if self.reason else ")")


@dataclass(frozen=True)
class ServingState:
    """The stages that cannot serve now; none: the application serves."""

    down: tuple[StageDown, ...] = ()
    known: bool = True  # False until the watch has read Serve's status once

    @property
    def serving(self) -> bool:
        return self.known and not self.down

    def describe(self) -> str:
        if not self.known:
            return "the service is starting: the stages' status is not known yet"
        return "; ".join(d.describe() for d in self.down) or "serving"


def not_serving(state: ServingState, retry_after_s: int) -> JSONResponse:
    """The OpenAI error object for a service that cannot serve, with Retry-After."""
    return errors.error_json(503, f"not serving: {state.describe()}", None, "stage_not_running", "overloaded",
                             {"Retry-After": str(retry_after_s)})


class NotServingGate:
    """ASGI middleware: ``POST`` to ``paths`` (generations, video jobs) is a 503 with Retry-After while
    the state says a stage is down. Plain ASGI, so a client's disconnect still cancels what it asked
    for on the routes it passes through (Starlette's BaseHTTPMiddleware would not)."""

    def __init__(self, app: ASGIApp, check, paths: frozenset[str], retry_after_s: int,
                 patterns: tuple[re.Pattern, ...] = ()):
        """``patterns``: paths with an id in them (a video's remix), matched whole."""
        self.app, self.check, self.paths, self.retry_after_s = app, check, paths, retry_after_s
        self.patterns = patterns

    def _gated(self, path: str) -> bool:
        return path in self.paths or any(p.fullmatch(path) for p in self.patterns)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope.get("method") == "POST" and self._gated(route_path(scope)):
            state = await self.check.confirm()
            if not state.serving:
                await not_serving(state, self.retry_after_s)(scope, receive, send)
                return
        await self.app(scope, receive, send)
