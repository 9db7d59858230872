"""The HTTP ingress: OpenAI-style routes composing the stage deployments through DeploymentHandles.

The encoder's response is handed to the denoiser unresolved, so the prompt embeddings go from the
encoder replica to the denoiser replica through Ray's object store; the denoiser streams progress
events and then the latents, which go to the decoder; only decoded frames become PNG/MP4 here.
"""

import asyncio
import base64
import hmac
import json
import logging
import time
from dataclasses import dataclass
from typing import AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from ray import serve
from ray.serve.handle import DeploymentHandle

from deployments import errors, media
from deployments.families import FamilyFacts
from deployments.residency_board import get_board, live_replicas
from deployments.schemas import (
    FieldError,
    ImageRequest,
    Limits,
    VideoRequest,
    image_spec,
    video_spec,
)
from deployments.spec import DenoiseProgress, GenerationSpec, StageOutput

logger = logging.getLogger(__name__)

api = FastAPI(title="offload-serve", version="0.1.0")


def _sse(event: str, data: dict) -> str:
    return f"event: {event}\ndata: {json.dumps(data)}\n\n"


@dataclass(frozen=True)
class IngressConfig:
    app_name: str
    model_id: str
    facts: FamilyFacts
    limits: Limits
    api_token: str | None  # None: no auth; else every route but /health needs "Bearer <token>"
    retry_after_s: int


@dataclass(frozen=True)
class Generated:
    spec: GenerationSpec
    frames: object  # torch.Tensor (n, frames, H, W, 3)
    stats: tuple  # tuple[StageStats, ...], in stage order


@serve.deployment(name="Ingress")
@serve.ingress(api)
class Ingress:
    """Validates requests, drives encoder -> denoiser -> decoder, and encodes the frames."""

    def __init__(self, encoder: DeploymentHandle, denoiser: DeploymentHandle, decoder: DeploymentHandle,
                 config: IngressConfig):
        self.encoder, self.denoiser, self.decoder = encoder, denoiser, decoder
        self.config = config
        self.board = get_board(config.app_name)
        logger.info("ingress for %s (%s, %s): auth %s, limits %s", config.model_id, config.facts.family.value,
                    config.facts.folder, "bearer token" if config.api_token else "off", config.limits)

    # -- plumbing -------------------------------------------------------------------------------
    def _unauthorized(self, request: Request) -> JSONResponse | None:
        if self.config.api_token is None:
            return None
        given = request.headers.get("authorization", "")
        if hmac.compare_digest(given.encode(), f"Bearer {self.config.api_token}".encode()):
            return None
        return errors.error_json(401, "missing or wrong bearer token", "authorization", "invalid_api_key",
                                 "authentication_error", {"WWW-Authenticate": "Bearer"})

    async def _parse(self, request: Request, model: type, to_spec: Callable) -> tuple | JSONResponse:
        """(parsed body, GenerationSpec), or the 4xx answer: checks auth, JSON, fields, then limits."""
        if (denied := self._unauthorized(request)) is not None:
            return denied
        try:
            body = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            return errors.error_json(400, f"body is not valid JSON: {exc}", "body", "invalid_json",
                                     "invalid_request_error")
        if not isinstance(body, dict):
            return errors.error_json(400, "body must be a JSON object", "body", "invalid_json",
                                     "invalid_request_error")
        try:
            parsed = model.model_validate(body)
            return parsed, to_spec(parsed, self.config.facts, self.config.limits, self.config.model_id)
        except ValidationError as exc:
            return errors.validation_error(exc)
        except FieldError as exc:
            return errors.field_error(exc)

    async def _generate(self, spec: GenerationSpec, on_progress=None) -> Generated:
        encoded = self.encoder.encode.remote(spec)
        latents = None
        async for item in self.denoiser.options(stream=True).denoise.remote(encoded, spec):
            if isinstance(item, DenoiseProgress):
                if on_progress is not None:
                    await on_progress(item)
            else:
                latents = item
        assert isinstance(latents, StageOutput), "the denoiser's stream must end with the latents"
        decoded: StageOutput = await self.decoder.decode.remote(latents, spec)
        enc: StageOutput = await encoded
        stats = (enc.stats, latents.stats, decoded.stats)
        per_stage = ", ".join(f"{s.stage} {s.seconds:.3f} s ({s.bytes_streamed} B streamed, peak "
                              f"{s.device_peak_bytes} B)" for s in stats)
        logger.info("request %s: %dx%d, %d frame(s), n=%d, %d steps: %s", spec.request_id, spec.width,
                    spec.height, spec.num_frames, spec.n, spec.steps, per_stage)
        return Generated(spec, decoded.value, stats)

    def _body(self, generated: Generated, data: list[dict]) -> dict:
        return {"created": int(time.time()), "id": generated.spec.request_id, "seed": generated.spec.seed,
                "data": data,
                "stages": [{"stage": s.stage, "seconds": round(s.seconds, 4), "bytes_streamed": s.bytes_streamed,
                            "device_peak_bytes": s.device_peak_bytes} for s in generated.stats]}

    def _image_body(self, generated: Generated) -> dict:
        images = [{"b64_json": base64.b64encode(media.png_bytes(item[0])).decode()} for item in generated.frames]
        return self._body(generated, images)

    async def _respond(self, spec: GenerationSpec, stream: bool, render: Callable[[Generated], Response | dict]):
        if stream:
            return StreamingResponse(self._events(spec, render), media_type="text/event-stream")
        try:
            generated = await self._generate(spec)
        except Exception as exc:  # mapped to 503 (overload, lost replica) or a logged 500
            return errors.overload_or_failure(exc, self.config.retry_after_s, spec.request_id)
        # PNG / H.264 encoding takes a core for a while on large outputs: off the event loop.
        result = await asyncio.to_thread(render, generated)
        return result if isinstance(result, Response) else JSONResponse(result)

    async def _events(self, spec: GenerationSpec, render) -> AsyncIterator[str]:
        """Server-Sent Events: "accepted", one "progress" per denoising step, then "result" or "error"."""
        progress: asyncio.Queue = asyncio.Queue()
        task = asyncio.ensure_future(self._generate(spec, progress.put))
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
            response = errors.overload_or_failure(exc, self.config.retry_after_s, spec.request_id)
            yield _sse("error", {"status": response.status_code, **json.loads(response.body)})
            return
        yield _sse("result", await asyncio.to_thread(render, generated))

    # -- routes ---------------------------------------------------------------------------------
    @api.get("/health")
    async def health(self) -> dict:
        return {"status": "ok", "model": self.config.model_id}

    @api.get("/v1/models")
    async def models(self, request: Request):
        if (denied := self._unauthorized(request)) is not None:
            return denied
        facts = self.config.facts
        return {"object": "list", "data": [{
            "id": self.config.model_id, "object": "model", "created": 0, "owned_by": "offload-serve",
            "family": facts.family.value, "modalities": ["image", "video"] if facts.supports_video else ["image"],
            "size_multiple": facts.size_multiple, "limits": self.config.limits.model_dump()}]}

    @api.get("/v1/residency")
    async def residency(self, request: Request):
        if (denied := self._unauthorized(request)) is not None:
            return denied
        alive = frozenset(await asyncio.to_thread(live_replicas))  # a GCS round trip: off the event loop
        reports = await self.board.snapshot.remote(alive)
        return {"replicas": [r.to_json() for r in reports]}

    @api.post("/v1/images/generations")
    async def images(self, request: Request):
        checked = await self._parse(request, ImageRequest, image_spec)
        if isinstance(checked, JSONResponse):
            return checked
        parsed, spec = checked
        return await self._respond(spec, parsed.stream, self._image_body)

    @api.post("/v1/videos/generations")
    async def videos(self, request: Request):
        checked = await self._parse(request, VideoRequest, video_spec)
        if isinstance(checked, JSONResponse):
            return checked
        parsed, spec = checked
        fps = parsed.fps or self.config.limits.default_fps
        if parsed.stream and parsed.response_format == "mp4":
            return errors.field_error(FieldError("stream", "a stream of events carries JSON; use "
                                                           "response_format 'b64_json' with stream"))

        def render(generated: Generated):
            video = media.mp4_bytes(generated.frames[0], fps)
            if parsed.response_format == "mp4":
                return Response(video, media_type="video/mp4", headers={"X-Request-Id": spec.request_id,
                                                                        "X-Seed": str(spec.seed)})
            return self._body(generated, [{"b64_json": base64.b64encode(video).decode(), "mime_type": "video/mp4",
                                           "frames": spec.num_frames, "fps": fps}])

        return await self._respond(spec, parsed.stream, render)
