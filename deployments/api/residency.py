"""Where the weights live: ``GET /v1/residency`` (every replica's report) and ``/v1/residency/picture``.

One router, mounted by :func:`deployments.api.routes.build_api` in the ingress replica's process;
it reads the residency board through ``app.state.service.board`` and answers 503 while the board
restarts.
"""
from __future__ import annotations

import asyncio
import logging

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from deployments.api import errors
from deployments.api.service import Service
from deployments.capacity.replica_report import REPUBLISH_S
from deployments.wire.failures import FailureKind

logger = logging.getLogger(__name__)

router = APIRouter()


def _board_restarting(service: Service, exc: Exception, route: str) -> JSONResponse:
    if service.stages.failure(exc).kind is not FailureKind.LOST_REPLICA:
        raise exc
    logger.warning("GET %s: the residency board is unreachable (%s); 503", route, type(exc).__name__)
    return errors.error_json(503, "the residency board is restarting; replicas report again within "
                                  f"{REPUBLISH_S:.0f} s; retry", None, "board_unavailable", "overloaded",
                             {"Retry-After": "1"})


@router.get("/v1/residency")
async def residency(request: Request):
    service: Service = request.app.state.service
    try:
        replicas, pending = await asyncio.gather(service.board.residency(), service.board.pending_replicas())
    except Exception as exc:
        return _board_restarting(service, exc, "/v1/residency")
    return {"replicas": [r.to_json() for r in replicas], "pending": [p.to_json() for p in pending]}


@router.get("/v1/residency/picture")
async def residency_picture(request: Request, replica: str | None = None):
    """A replica's plan as SVG: its weights by where they live, one pass predicted and measured."""
    service: Service = request.app.state.service
    try:
        reports = await service.board.residency()
    except Exception as exc:
        return _board_restarting(service, exc, "/v1/residency/picture")
    known = sorted(r.replica for r in reports if r.picture is not None)
    chosen = [r for r in reports if r.picture is not None and replica is not None
              and (r.replica == replica or r.replica.endswith(f"#{replica}"))]
    if len(chosen) != 1:
        why = "name one replica" if replica is None else f"no replica {replica!r} has a picture"
        return errors.error_json(404 if replica is not None else 400, f"{why}; replicas: {known or 'none yet'}",
                                 "replica", "unknown_replica", "invalid_request_error")
    from offload_core.planner.picture import render  # matplotlib: imported on the first picture only

    svg = await asyncio.to_thread(render, chosen[0].picture, "svg")  # ~0.1-1 s of CPU: off the event loop
    return Response(svg, media_type="image/svg+xml")
