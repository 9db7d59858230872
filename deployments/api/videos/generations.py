"""``POST /v1/videos/generations``: one video in one synchronous request (this server's own; OpenAI's Videos
API is the queued ``/v1/videos``), answered as JSON, as the mp4 itself, or as Server-Sent Events.

The route parses its body, then answers through :class:`deployments.api.service.Service`
(``app.state.service``). Mounted by :func:`deployments.api.routes.build_api` in the ingress replica's process.
"""
from __future__ import annotations

from fastapi import APIRouter, Request

from deployments.api.rendering import VideoRendering
from deployments.api.service import Service
from deployments.api.videos.protocol import VideoRequest, video_spec

VIDEOS = "/v1/videos/generations"

router = APIRouter()


@router.post(VIDEOS)
async def videos(request: Request):
    service: Service = request.app.state.service
    fps = service.config.limits.default_fps
    return await service.answer(request, VideoRequest, video_spec,
                                lambda body: VideoRendering(body.fps or fps, as_mp4=body.response_format == "mp4"))
