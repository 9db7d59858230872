"""The synchronous generation routes: ``POST /v1/images/generations`` and ``/v1/videos/generations``.

One router, mounted by :func:`deployments.api.routes.build_api` in the ingress replica's process;
each route parses its body, then answers in one piece or as Server-Sent Events through
:class:`deployments.api.service.Service` (``app.state.service``).
"""
from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from deployments.api import errors
from deployments.api.rendering import ImageRendering, VideoRendering
from deployments.api.schemas import ImageRequest, VideoRequest, image_spec, video_spec
from deployments.api.service import Service
from deployments.capacity.request_limits import FieldError

IMAGES, VIDEOS = "/v1/images/generations", "/v1/videos/generations"

router = APIRouter()


def _service(request: Request) -> Service:
    return request.app.state.service


@router.post(IMAGES)
async def images(request: Request):
    service = _service(request)
    checked = await service.parse(request, ImageRequest, image_spec)
    if isinstance(checked, JSONResponse):
        return checked
    parsed, spec = checked
    rendering = ImageRendering(parsed.output_format, parsed.output_compression)
    return await service.respond(spec, parsed.stream, rendering)


@router.post(VIDEOS)
async def videos(request: Request):
    service = _service(request)
    checked = await service.parse(request, VideoRequest, video_spec)
    if isinstance(checked, JSONResponse):
        return checked
    parsed, spec = checked
    if parsed.stream and parsed.response_format == "mp4":
        return errors.field_error(FieldError("stream", "a stream of events carries JSON; use "
                                                       "response_format 'b64_json' with stream"))
    rendering = VideoRendering(parsed.fps or service.config.limits.default_fps, as_mp4=parsed.response_format == "mp4")
    return await service.respond(spec, parsed.stream, rendering)
