"""The HTTP API as a plain FastAPI app over the two seams (:mod:`deployments.api.seams`).

:func:`build_api` is what the Serve ingress serves and what the unit tests drive with fakes:
OpenAI-style routes, Server-Sent Events, the OpenAI error object for every 4xx/5xx (404, 405 and
422 included), and cancellation of the stage calls when the client goes away.
"""
from __future__ import annotations

import asyncio
import base64
import dataclasses
import json
import logging
import time
from dataclasses import dataclass
from typing import AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException

from deployments.api import errors, video_jobs
from deployments.api.body import BodyError, parse_object
from deployments.api.guard import JSON_TYPES, Guard, GuardConfig, request_id
from deployments.api.model_list import ModelList, model_card
from deployments.api.schemas import ImageRequest, VideoRequest, image_spec, video_spec
from deployments.api.seams import ReplicaBoard, ServingCheck, StagePipeline
from deployments.api.serving import NotServingGate, not_serving
from deployments.capacity.admission import StageAdmission
from deployments.capacity.replica_report import REPUBLISH_S
from deployments.capacity.request_limits import FieldError, Limits
from deployments.jobs.queue import JobsArgs
from deployments.models.families import FamilyFacts
from deployments.wire import media
from deployments.wire.failures import FailureKind
from deployments.wire.spec import DenoiseProgress, GenerationSpec, StageOutput

logger = logging.getLogger(__name__)

IMAGES, VIDEOS = "/v1/images/generations", "/v1/videos/generations"
# Images this small are encoded on the event loop: PNG takes 0.32 ms per 64x64 image here, less
# than the trip to a worker thread and back on a busy 2-core node (0.6-1.8 ms measured from the
# decoder's answer to the response). Larger ones, and every MP4, go to a thread.
INLINE_RENDER_VALUES = 4 * 64 * 64 * 3


@dataclass(frozen=True)
class IngressConfig:
    app_name: str
    model_id: str
    facts: FamilyFacts
    limits: Limits
    api_token: str | None  # None: no auth; else every route but /health needs "Bearer <token>"
    retry_after_s: int
    cors_origins: tuple[str, ...] = ()  # empty: no CORS headers (see deployments.api.guard)
    jobs: JobsArgs = JobsArgs()  # the Videos API's jobs (deployments.api.video_jobs)


@dataclass(frozen=True)
class Generated:
    spec: GenerationSpec
    frames: object  # torch.Tensor (n, frames, H, W, 3)
    stats: tuple  # tuple[StageStats, ...], in stage order


def _cancel(stream) -> None:
    """Stop the Denoiser's call when its reader leaves early (cancelled between two steps, or
    ``on_progress`` failed). Serve passes a cancelled *request's* cancellation on to the calls it
    made, but the video job runner is a background task, not a request: so it is cancelled here,
    explicitly (``DeploymentResponseGenerator.cancel``; in-process fakes have none)."""
    cancel = getattr(stream, "cancel", None)
    if cancel is not None:
        cancel()


def _sse(event: str, data: dict) -> str:
    return f"event: {event}\ndata: {json.dumps(data)}\n\n"


class Service:
    """Validation, the encode -> denoise -> decode drive, and rendering; no Serve, no Ray."""

    def __init__(self, config: IngressConfig, stages: StagePipeline, board: ReplicaBoard):
        self.config, self.stages, self.board = config, stages, board

    async def parse(self, request: Request, model: type, to_spec: Callable) -> tuple | JSONResponse:
        """(parsed body, GenerationSpec), or the 4xx answer: bounded JSON, fields, then limits."""
        try:
            body = parse_object(await request.body())
            parsed = model.model_validate(body)
            spec = to_spec(parsed, self.config.facts, self.config.limits, self.config.model_id)
        except BodyError as exc:
            return errors.error_json(exc.status, exc.message, "body", exc.code, "invalid_request_error")
        except ValidationError as exc:
            return errors.validation_error(exc)
        except FieldError as exc:
            return errors.field_error(exc)
        # One id from Serve's proxy to the stages' logs and the error bodies.
        return parsed, dataclasses.replace(spec, request_id=request_id(request.scope))

    async def generate(self, spec: GenerationSpec, on_progress=None) -> Generated:
        encoded = self.stages.encode(spec)
        latents = None
        # Progress events only for a caller that reads them (SSE, video jobs): each is one more
        # message from the Denoiser to the ingress and a wake-up of both (~1.5 ms each on 2 cores).
        stream = self.stages.denoise(encoded, spec, progress=on_progress is not None)
        try:
            async for item in stream:
                if isinstance(item, DenoiseProgress):
                    if on_progress is not None:
                        await on_progress(item)
                else:
                    latents = item
                    break  # the last item: no wait for the call's end of stream (one more message, ~1-1.7 ms)
        except BaseException:
            _cancel(stream)
            raise
        if not isinstance(latents, StageOutput):
            raise RuntimeError("the denoiser's stream ended without the latents")
        decoded: StageOutput = await self.stages.decode(latents, spec)
        stats = decoded.all_stats  # the encoder's output itself is never fetched here
        per_stage = ", ".join(f"{s.stage} {s.seconds:.3f} s ({s.bytes_streamed} B streamed, peak "
                              f"{s.device_peak_bytes} B)" for s in stats)
        logger.info("request %s: %dx%d, %d frame(s), n=%d, %d steps: %s", spec.request_id, spec.width,
                    spec.height, spec.num_frames, spec.n, spec.steps, per_stage)
        return Generated(spec, decoded.value, stats)

    def body(self, generated: Generated, data: list[dict]) -> dict:
        return {"created": int(time.time()), "id": generated.spec.request_id, "seed": generated.spec.seed,
                "data": data,
                "stages": [{"stage": s.stage, "replica": s.replica, "seconds": round(s.seconds, 4),
                            "started_at": round(s.started_at, 6),
                            "bytes_streamed": s.bytes_streamed,
                            "device_peak_bytes": s.device_peak_bytes,
                            **({"steps": s.steps, "cache_skips": s.cache_skips} if s.steps else {})}
                           for s in generated.stats]}

    def image_body(self, generated: Generated) -> dict:
        images = [{"b64_json": base64.b64encode(media.png_bytes(item[0])).decode()} for item in generated.frames]
        return self.body(generated, images)

    async def respond(self, spec: GenerationSpec, stream: bool, render: Callable[[Generated], Response | dict]):
        """The answer to a valid request. A client that disconnects cancels this coroutine (Serve's
        proxy cancels it; for SSE, Starlette cancels the stream), and with it the stage calls."""
        if stream:
            return StreamingResponse(self.events(spec, render), media_type="text/event-stream")
        try:
            generated = await self.generate(spec)
        except asyncio.CancelledError:
            logger.info("request %s cancelled: the client went away", spec.request_id)
            raise
        except Exception as exc:  # 4xx (request-caused), 503 (overload, lost replica) or a logged 500
            return errors.overload_or_failure(self.stages.failure(exc), self.config.retry_after_s, spec.request_id)
        result = await self.render(render, generated)
        return result if isinstance(result, Response) else JSONResponse(result)

    async def events(self, spec: GenerationSpec, render) -> AsyncIterator[str]:
        """Server-Sent Events: "accepted", one "progress" per denoising step, then "result" or "error"."""
        progress: asyncio.Queue = asyncio.Queue()
        task = asyncio.ensure_future(self.generate(spec, progress.put))
        try:
            yield _sse("accepted", {"id": spec.request_id, "total_steps": spec.steps})
            while not (task.done() and progress.empty()):
                getter = asyncio.ensure_future(progress.get())
                done, _ = await asyncio.wait({getter, task}, return_when=asyncio.FIRST_COMPLETED)
                if getter not in done:
                    getter.cancel()
                    continue
                step: DenoiseProgress = getter.result()
                yield _sse("progress", {"id": step.request_id, "step": step.step, "total": step.total,
                                        "message": f"step {step.step} of {step.total}"})
            try:
                generated = task.result()
            except Exception as exc:  # same mapping as the plain response, as an "error" event
                response = errors.overload_or_failure(self.stages.failure(exc), self.config.retry_after_s, spec.request_id)
                yield _sse("error", {"status": response.status_code, **json.loads(response.body)})
                return
            yield _sse("result", await self.render(render, generated))
        finally:
            if not task.done():  # the client went away mid-stream: stop the stages too
                logger.info("request %s cancelled: the event stream's client went away", spec.request_id)
                task.cancel()

    async def render(self, render: Callable[[Generated], Response | dict], generated: Generated):
        """PNG / H.264 encoding takes a core for a while on large outputs: off the event loop,
        unless the output is a few small images (INLINE_RENDER_VALUES)."""
        if render == self.image_body and generated.frames.numel() <= INLINE_RENDER_VALUES:
            return render(generated)
        return await asyncio.to_thread(render, generated)

    async def admissions(self) -> tuple[StageAdmission, ...]:
        """What every reporting stage replica admits; none while the board is unreachable (restarting):
        the replicas still refuse what their share cannot hold."""
        try:
            reports = await self.board.residency()
        except Exception as exc:
            if self.stages.failure(exc).kind is not FailureKind.LOST_REPLICA:
                raise
            logger.warning("the residency board is unreachable (%s); no replica's admission is known",
                           type(exc).__name__)
            return ()
        return tuple(r.admission for r in reports if r.admission is not None)

    async def models(self) -> ModelList:
        """The served model with the largest request it accepts, from the replicas' reports (capacity.admission);
        the configured limits (``source: configured``) until every stage has reported."""
        admissions = await self.admissions()
        return ModelList(data=[model_card(self.config.model_id, self.config.facts, self.config.limits, admissions)])

    def video_renderer(self, spec: GenerationSpec, parsed: VideoRequest) -> Callable[[Generated], Response | dict]:
        fps = parsed.fps or self.config.limits.default_fps

        def render(generated: Generated):
            video = media.mp4_bytes(generated.frames[0], fps)
            if parsed.response_format == "mp4":
                return Response(video, media_type="video/mp4", headers={"X-Seed": str(spec.seed)})
            return self.body(generated, [{"b64_json": base64.b64encode(video).decode(), "mime_type": "video/mp4",
                                          "frames": spec.num_frames, "fps": fps}])

        return render


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
    service = Service(config, stages, board)
    api = FastAPI(title="offload-serve", version="0.1.0")
    _install_error_handlers(api)

    @api.get("/health")
    async def health():
        """200 while every stage deployment has a running replica; else 503 naming the stage and
        Serve's reason (a readiness probe's route: the ingress itself answers either way)."""
        state = await serving.confirm() if serving is not None else None
        if state is not None and not state.serving:
            return not_serving(state, config.retry_after_s)
        return {"status": "ok", "model": config.model_id}

    @api.get("/v1/models", response_model=ModelList)
    async def models() -> ModelList:
        listed = await service.models()
        state = await serving.confirm() if serving is not None else None
        if state is None or state.serving:
            return listed
        down = {"serving": False, "not_serving": state.describe()}
        return listed.model_copy(update={"data": [card.model_copy(update=down) for card in listed.data]})

    def board_restarting(exc: Exception, route: str) -> JSONResponse:
        if stages.failure(exc).kind is not FailureKind.LOST_REPLICA:
            raise exc
        logger.warning("GET %s: the residency board is unreachable (%s); 503", route, type(exc).__name__)
        return errors.error_json(503, "the residency board is restarting; replicas report again within "
                                      f"{REPUBLISH_S:.0f} s; retry", None, "board_unavailable", "overloaded",
                                 {"Retry-After": "1"})

    @api.get("/v1/residency")
    async def residency():
        try:
            replicas, pending = await asyncio.gather(board.residency(), board.pending_replicas())
        except Exception as exc:
            return board_restarting(exc, "/v1/residency")
        return {"replicas": [r.to_json() for r in replicas], "pending": [p.to_json() for p in pending]}

    @api.get("/v1/residency/picture")
    async def residency_picture(replica: str | None = None):
        """A replica's plan as SVG: its weights by where they live, one pass predicted and measured."""
        try:
            reports = await board.residency()
        except Exception as exc:
            return board_restarting(exc, "/v1/residency/picture")
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

    @api.post(IMAGES)
    async def images(request: Request):
        checked = await service.parse(request, ImageRequest, image_spec)
        if isinstance(checked, JSONResponse):
            return checked
        parsed, spec = checked
        return await service.respond(spec, parsed.stream, service.image_body)

    @api.post(VIDEOS)
    async def videos(request: Request):
        checked = await service.parse(request, VideoRequest, video_spec)
        if isinstance(checked, JSONResponse):
            return checked
        parsed, spec = checked
        if parsed.stream and parsed.response_format == "mp4":
            return errors.field_error(FieldError("stream", "a stream of events carries JSON; use "
                                                           "response_format 'b64_json' with stream"))
        return await service.respond(spec, parsed.stream, service.video_renderer(spec, parsed))

    api.state.service = service  # the video jobs API (and tests) reach the same drive through it
    if jobs is not None:
        video_jobs.mount(api, video_jobs.VideoJobsConfig(config.model_id, config.facts, config.limits, config.jobs),
                     jobs, service.generate, config.retry_after_s, stages.failure, service.admissions)
    if serving is not None:  # inside the Guard (added after): a request without the token is still a 401
        api.add_middleware(NotServingGate, check=serving, paths=frozenset({IMAGES, VIDEOS, video_jobs.CREATE}),
                           retry_after_s=config.retry_after_s)
    guard = GuardConfig(config.api_token, config.cors_origins, ((IMAGES, JSON_TYPES), (VIDEOS, JSON_TYPES),
                                                                (video_jobs.CREATE, video_jobs.CREATE_TYPES)))
    api.add_middleware(Guard, config=guard)
    return api
