"""The HTTP API as a plain FastAPI app over the two seams (:mod:`deployments.api.seams`).

:func:`build_api` is what the Serve ingress serves and what the unit tests drive with fakes. It
only assembles: one router per family of endpoints (the images API, status, residency, the synchronous video route,
and the Videos API with a jobs backend), the OpenAI error object for every 4xx/5xx (404, 405 and 422
included), the not-serving gate and the guard. The drive behind the routes (validation, the
stage calls, Server-Sent Events, cancellation when the client goes away) is
:class:`deployments.api.service.Service`.
"""
from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException

from deployments.api import errors, residency, status
from deployments.api.body import FORM_TYPES
from deployments.api.guard import JSON_TYPES, Guard, GuardConfig, request_id
from deployments.api.images import edits as image_edits
from deployments.api.images import generations as image_generations
from deployments.api.images import variations as image_variations
from deployments.api.images.edits import EDITS
from deployments.api.images.generations import IMAGES
from deployments.api.seams import ReplicaBoard, ServingCheck, StagePipeline
from deployments.api.service import Generated, IngressConfig, Service
from deployments.api.serving import NotServingGate
from deployments.api.videos import generations as video_generations
from deployments.api.videos import jobs as video_jobs
from deployments.api.videos.generations import VIDEOS

__all__ = ["EDITS", "IMAGES", "VIDEOS", "Generated", "IngressConfig", "Service", "build_api"]

# Images this small are encoded on the event loop: PNG takes 0.32 ms per 64x64 image here, less
# than the trip to a worker thread and back on a busy 2-core node (0.6-1.8 ms measured from the
# decoder's answer to the response). Larger ones, and every MP4, go to a thread.
INLINE_RENDER_VALUES = 4 * 64 * 64 * 3


def _install_error_handlers(api: FastAPI) -> None:
    """FastAPI's own 404/405/422/500 answers, as OpenAI error objects."""

    async def http_error(request: Request, exc: HTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        param = "method" if exc.status_code == 405 else "path" if exc.status_code == 404 else None
        message = f"{request.method} {request.url.path}: {exc.detail}"
        return errors.error_json(exc.status_code, message, param, code, "invalid_request_error",
                                 dict(exc.headers or {}))

    async def invalid(request: Request, exc: RequestValidationError):
        first = (exc.errors() or [{}])[0]
        param = ".".join(str(part) for part in first.get("loc", ())) or "body"
        return errors.error_json(422, f"{param}: {first.get('msg', 'invalid')}", param, "invalid_value",
                                 "invalid_request_error")

    async def crashed(request: Request, exc: Exception):
        return errors.internal_error(request_id(request.scope), exc)

    api.add_exception_handler(HTTPException, http_error)
    api.add_exception_handler(RequestValidationError, invalid)
    api.add_exception_handler(Exception, crashed)


def build_api(config: IngressConfig, stages: StagePipeline, board: ReplicaBoard,
              jobs: video_jobs.JobsBackend | None = None, serving: ServingCheck | None = None) -> FastAPI:
    """The whole HTTP API over ``stages`` and ``board``; with ``jobs``, the Videos API (/v1/videos) too;
    with ``serving``, health, models and new work follow whether every stage runs."""
    service = Service(config, stages, board, INLINE_RENDER_VALUES)
    api = FastAPI(title="offload-serve", version="0.1.0")
    _install_error_handlers(api)
    # The routers reach the drive (and tests reach it) through the app's state.
    api.state.service, api.state.serving = service, serving
    for router in (status.router, residency.router, image_generations.router, image_edits.router,
                   image_variations.router, video_generations.router):
        api.include_router(router)
    if jobs is not None:
        video_jobs.mount(api, video_jobs.VideoJobsConfig(config.model_id, config.facts, config.limits, config.jobs,
                                                                   loras=config.loras),
                         jobs, service.generate, config.retry_after_s, stages.failure, service.admissions)
    if serving is not None:  # inside the Guard (added after): a request without the token is still a 401
        api.add_middleware(NotServingGate, check=serving, retry_after_s=config.retry_after_s,
                           paths=frozenset({IMAGES, EDITS, VIDEOS, video_jobs.CREATE, video_jobs.VIDEO_EDITS,
                                            video_jobs.VIDEO_EXTENSIONS}),
                           patterns=(video_jobs.REMIX,))
    guard = GuardConfig(config.api_token, config.cors_origins, ((IMAGES, JSON_TYPES), (VIDEOS, JSON_TYPES),
                                                                (EDITS, FORM_TYPES),
                                                                (video_jobs.CREATE, video_jobs.CREATE_TYPES),
                                                                (video_jobs.VIDEO_EDITS, FORM_TYPES),
                                                                (video_jobs.VIDEO_EXTENSIONS, FORM_TYPES)))
    api.add_middleware(Guard, config=guard)
    return api
