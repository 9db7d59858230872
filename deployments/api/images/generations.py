"""``POST /v1/images/generations``: OpenAI's image generation, answered in one piece or as Server-Sent Events.

The route parses its body, then answers through :class:`deployments.api.service.Service`
(``app.state.service``). Mounted by :func:`deployments.api.routes.build_api` in the ingress replica's process.
"""
from __future__ import annotations

from fastapi import APIRouter, Request

from deployments.api.images.protocol import ImageRequest, image_spec
from deployments.api.rendering import ImageRendering
from deployments.api.service import Service

IMAGES = "/v1/images/generations"

router = APIRouter()


@router.post(IMAGES)
async def images(request: Request):
    service: Service = request.app.state.service
    return await service.answer(request, ImageRequest, image_spec,
                                lambda body: ImageRendering(body.output_format, body.output_compression))
