"""``POST /v1/images/generations``: OpenAI's image generation, answered in one piece or as Server-Sent Events.

The route parses its body, then answers through :class:`deployments.api.service.Service`
(``app.state.service``). Mounted by :func:`deployments.api.routes.build_api` in the ingress replica's process.
"""
from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from deployments.api.images.protocol import ImageRequest, image_spec
from deployments.api.rendering import ImageRendering
from deployments.api.service import Service

IMAGES = "/v1/images/generations"

router = APIRouter()


@router.post(IMAGES)
async def images(request: Request):
    service: Service = request.app.state.service
    checked = await service.parse(request, ImageRequest, image_spec)
    if isinstance(checked, JSONResponse):
        return checked
    parsed, spec = checked
    rendering = ImageRendering(parsed.output_format, parsed.output_compression)
    return await service.respond(spec, parsed.stream, rendering)
