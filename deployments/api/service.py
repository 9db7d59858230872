"""The drive behind the HTTP routes: validation, encode -> denoise -> decode, rendering, Server-Sent Events.

:class:`Service` runs in the ingress replica's process; the routers (:mod:`deployments.api.images`,
:mod:`deployments.api.videos.generations`, :mod:`deployments.api.status`, :mod:`deployments.api.residency`, :mod:`deployments.api.videos.jobs`)
reach it through ``app.state.service``. No Serve, no Ray: the stages and the board are the Protocols
of :mod:`deployments.api.seams`.
"""
from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import logging
from dataclasses import dataclass
from typing import AsyncIterator, Awaitable, Callable

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError
from sse_starlette import EventSourceResponse, ServerSentEvent

from deployments.api import errors
from deployments.api.body import BodyError, parse_object
from deployments.api.guard import request_id
from deployments.api.model_list import ModelList, model_card
from deployments.api.rendering import Generated, ImageRendering, Rendering
from deployments.api.seams import ReplicaBoard, StagePipeline
from deployments.capacity.admission import StageAdmission
from deployments.capacity.request_limits import FieldError, Limits
from deployments.jobs.queue import JobsArgs
from deployments.models.families import FamilyTraits
from deployments.models.lora_rows import ServedLora
from deployments.wire.failures import FailureKind
from deployments.wire.spec import DenoiseProgress, GenerationSpec, StageOutput, StageStats

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class IngressConfig:
    app_name: str
    model_id: str
    facts: FamilyTraits
    limits: Limits
    api_token: str | None  # None: no auth; else every route but /health needs "Bearer <token>"
    retry_after_s: int
    cors_origins: tuple[str, ...] = ()  # empty: no CORS headers (see deployments.api.guard)
    jobs: JobsArgs = JobsArgs()  # the Videos API's jobs (deployments.api.videos.jobs)
    loras: tuple[ServedLora, ...] = ()  # the LoRA adapters a request may name (args.lora_adapters)


def _cancel(stream) -> None:
    """Stop the Denoiser's call when its reader leaves early (cancelled between two steps, or
    ``on_progress`` failed). Serve passes a cancelled *request's* cancellation on to the calls it
    made, but the video job runner is a background task, not a request: so it is cancelled here,
    explicitly (``DeploymentResponseGenerator.cancel``; in-process fakes have none)."""
    cancel = getattr(stream, "cancel", None)
    if cancel is not None:
        cancel()


def _sse(event: str, data: dict) -> ServerSentEvent:
    return ServerSentEvent(json.dumps({"type": event, **data}), event=event, sep="\n")


class Service:
    """Validation, the encode -> denoise -> decode drive, and rendering; no Serve, no Ray."""

    def __init__(self, config: IngressConfig, stages: StagePipeline, board: ReplicaBoard, inline_render_values: int):
        self.config, self.stages, self.board = config, stages, board
        self.inline_render_values = inline_render_values  # outputs up to this many values render on the loop

    async def parse(self, request: Request, model: type, to_spec: Callable,
                    read: Callable[[Request], Awaitable[dict]] | None = None) -> tuple | JSONResponse:
        """(parsed body, GenerationSpec), or the 4xx answer: bounded JSON (or what ``read`` reads: a form),
        fields, then limits."""
        try:
            body = parse_object(await request.body()) if read is None else await read(request)
            parsed = model.model_validate(body)
            spec = to_spec(parsed, self.config.facts, self.config.limits, self.config.model_id,
                           loras=self.config.loras)
        except BodyError as exc:
            return errors.error_json(exc.status, exc.message, "body", exc.code, "invalid_request_error")
        except ValidationError as exc:
            return errors.validation_error(exc)
        except FieldError as exc:
            return errors.field_error(exc)
        # One id from Serve's proxy to the stages' logs and the error bodies.
        return parsed, dataclasses.replace(spec, request_id=request_id(request.scope))

    async def answer(self, request: Request, model: type, to_spec: Callable, rendering: Callable[[object], Rendering],
                     read: Callable[[Request], Awaitable[dict]] | None = None):
        """A synchronous generation route's whole answer: :meth:`parse`, then :meth:`respond` with the
        ``rendering`` the parsed body asks for (its encoding, its frame rate)."""
        checked = await self.parse(request, model, to_spec, read)
        if isinstance(checked, JSONResponse):
            return checked
        parsed, spec = checked
        return await self.respond(spec, parsed.stream, rendering(parsed))

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

    async def respond(self, spec: GenerationSpec, stream: bool, rendering: Rendering):
        """The answer to a valid request. A client that disconnects cancels this coroutine (Serve's
        proxy cancels it; for SSE, Starlette cancels the stream), and with it the stage calls."""
        if stream:
            # sse-starlette frames the events, pings a quiet stream every 15 s (a long step keeps a
            # proxy's idle timer from closing it) and cancels the generator when the client leaves.
            return EventSourceResponse(self.events(spec, rendering), sep="\n")
        try:
            generated = await self.generate(spec)
        except asyncio.CancelledError:
            logger.info("request %s cancelled: the client went away", spec.request_id)
            raise
        except Exception as exc:  # 4xx (request-caused), 503 (overload, lost replica) or a logged 500
            return errors.overload_or_failure(self.stages.failure(exc), self.config.retry_after_s, spec.request_id)
        result = await self.render(rendering, generated)
        return result if isinstance(result, Response) else JSONResponse(result)

    async def events(self, spec: GenerationSpec, rendering: Rendering) -> AsyncIterator[ServerSentEvent]:
        """Server-Sent Events: "accepted", one "progress" per denoising step, then the rendering's closing
        events (``deployments.api.rendering``) or "error". Each event's data names its ``type``, as
        OpenAI's do: the official client reads an event's fields from its data alone."""
        progress: asyncio.Queue = asyncio.Queue()
        task = asyncio.ensure_future(self.generate(spec, progress.put))
        try:
            yield _sse("accepted", {"id": spec.request_id, "total_steps": spec.run_steps})
            while not (task.done() and progress.empty()):
                getter = asyncio.ensure_future(progress.get())
                done, _ = await asyncio.wait({getter, task}, return_when=asyncio.FIRST_COMPLETED)
                if getter not in done:
                    getter.cancel()
                    continue
                step: DenoiseProgress = getter.result()
                yield _sse("progress", {"id": step.request_id, "step": step.step, "total": step.total,
                                        "message": f"step {step.step} of {step.total}"})
                if step.preview is not None and isinstance(rendering, ImageRendering):
                    for event, data in await self.preview(spec, rendering, step):
                        yield _sse(event, data)
            try:
                generated = task.result()
            except Exception as exc:  # same mapping as the plain response, as an "error" event
                response = errors.overload_or_failure(self.stages.failure(exc), self.config.retry_after_s, spec.request_id)
                # {"error": {...}}: what the official client raises as APIError with the message.
                yield _sse("error", {"status": response.status_code, **json.loads(response.body)})
                return
            for event, data in await self.render(rendering, generated, rendering.events):
                yield _sse(event, data)
        finally:
            if not task.done():  # the client went away mid-stream: stop the stages too
                logger.info("request %s cancelled: the event stream's client went away", spec.request_id)
                task.cancel()

    async def preview(self, spec: GenerationSpec, rendering: ImageRendering, step: DenoiseProgress) -> list:
        """A preview's events: its latents decoded by the VaeDecoder (the Denoiser goes on meanwhile;
        its progress waits in the queue). A preview that fails is not sent, as OpenAI's stream may send
        fewer than asked; the finished image is what the request is answered with, or fails with."""
        index = sorted(spec.preview_steps).index(step.step)
        try:
            decoded = await self.stages.decode(StageOutput(step.preview, StageStats("denoise", "preview", 0.0, 0, 0)),
                                               spec)
        except Exception as exc:  # the finished image's decode meets the same fault and answers it
            failure = self.stages.failure(exc)
            logger.warning("request %s: preview %d (after step %d of %d) not sent: %s (%s: %s)", spec.request_id,
                           index, step.step, step.total, failure.kind.value, type(failure.cause).__name__,
                           failure.cause)
            return []
        generated = Generated(spec, decoded.value, decoded.all_stats)
        return await self.render(rendering, generated, functools.partial(rendering.partial_events,
                                                                         partial_image_index=index, step=step.step))

    async def render(self, rendering: Rendering, generated: Generated, make: Callable | None = None):
        """``make(generated)``: by default ``rendering``'s body. Image / H.264 encoding takes a core for a
        while on large outputs: off the event loop, unless the output is a few small images
        (``inline_render_values``)."""
        render = rendering.body if make is None else make
        if isinstance(rendering, ImageRendering) and generated.frames.numel() <= self.inline_render_values:
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
        return ModelList(data=[model_card(self.config.model_id, self.config.facts, self.config.limits, admissions,
                                          self.config.loras)])
