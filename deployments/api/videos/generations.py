"""``POST /v1/videos/generations``: one video in one synchronous request (this server's own; OpenAI's Videos
API is the queued ``/v1/videos``), answered as JSON, as the mp4 itself, or as Server-Sent Events.

The route parses its body, then answers through :class:`deployments.api.service.Service`
(``app.state.service``). Mounted by :func:`deployments.api.routes.build_api` in the ingress replica's process.
"""
from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from deployments.api import errors
from deployments.api.rendering import VideoRendering
from deployments.api.service import Service
from deployments.api.videos.protocol import VideoRequest, video_spec
from deployments.capacity.request_limits import FieldError

VIDEOS = "/v1/videos/generations"

router = APIRouter()


@router.post(VIDEOS)
async def videos(request: Request):
    service: Service = request.app.state.service
    checked = await service.parse(request, VideoRequest, video_spec)
    if isinstance(checked, JSONResponse):
        return checked
    parsed, spec = checked
    if parsed.stream and parsed.response_format == "mp4":
        return errors.field_error(FieldError("stream", "a stream of events carries JSON; use "
                                                       "response_format 'b64_json' with stream"))
    rendering = VideoRendering(parsed.fps or service.config.limits.default_fps, as_mp4=parsed.response_format == "mp4")
    return await service.respond(spec, parsed.stream, rendering)
