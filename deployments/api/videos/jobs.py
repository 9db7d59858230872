"""The OpenAI Videos API: ``/v1/videos`` create, retrieve, list, download, delete, remix.

A video is a job: ``POST /v1/videos`` answers at once with a queued video object, a runner in
some ingress replica generates it (:mod:`deployments.jobs.runner`), clients poll
``GET /v1/videos/{id}`` (``progress`` follows the denoising steps) and download
``GET /v1/videos/{id}/content`` (``?variant=thumbnail`` for the first frame as PNG, ``spritesheet`` for up to 16
frames tiled as JPEG).
``DELETE /v1/videos/{id}`` cancels a queued or running job and removes its result.
``POST /v1/videos/{id}/remix`` and ``POST /v1/videos/edits`` queue a new job that edits a completed
video's frames, or an uploaded video's, toward a new prompt; ``POST /v1/videos/extensions`` one that goes on
from its last frame (:mod:`deployments.api.videos.edits`).

:func:`mount` adds the routes to the app :func:`deployments.api.routes.build_api` makes (its guard
checks the bearer token and the content types first) and starts this replica's runner over the
same encode -> denoise -> decode drive as the synchronous routes.
"""
from __future__ import annotations

import asyncio
import logging
import re
import time
from dataclasses import dataclass
from typing import Awaitable, Callable, Sequence

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from deployments.api import errors
from deployments.api.body import FORM_TYPES, read_fields
from deployments.api.reference_images import MAX_REFERENCE_BYTES
from deployments.api.videos.create import VideoJobRequest, job_params
from deployments.api.videos.edit_jobs import JOB_ID, VideoEditJobs
from deployments.capacity.admission import StageAdmission, memory_refusal
from deployments.capacity.request_limits import FieldError, Limits
from deployments.jobs.queue import JobQueue, JobsArgs
from deployments.jobs.records import JobParams, JobStatus, ListOrder, VideoJob, new_job, new_job_id
from deployments.jobs.results import ResultFolder, Variant
from deployments.jobs.runner import Generate, JobRunner, params_spec
from deployments.models.families import FamilyTraits
from deployments.models.lora_rows import ServedLora
from deployments.wire.failures import FailureKind, FailureSorter

logger = logging.getLogger(__name__)

router = APIRouter()

CREATE = "/v1/videos"
CREATE_TYPES = FORM_TYPES
REMIX = re.compile(r"/v1/videos/video_[0-9a-f]{24}/remix")  # POST, a remix of that video (matched whole)
VIDEO_EDITS = "/v1/videos/edits"
VIDEO_EXTENSIONS = "/v1/videos/extensions"
# A create body is a prompt or two (2,000 characters each by default) and a few numbers.
MAX_CREATE_BYTES = 256 * 1024
MAX_LIST_LIMIT = 100
# What the stage replicas admit now (deployments.api.routes.Service.admissions).
Admissions = Callable[[], Awaitable[Sequence[StageAdmission]]]


@dataclass(frozen=True)
class VideoJobsConfig:
    model_id: str
    facts: FamilyTraits
    limits: Limits
    args: JobsArgs
    loras: tuple[ServedLora, ...] = ()  # the LoRA adapters a job may name (IngressConfig.loras)


@dataclass(frozen=True)
class JobsBackend:
    """What the jobs API runs on: the application's queue, the results location, this runner's id."""

    queue: JobQueue
    results: ResultFolder
    owner: str  # the ingress replica, as the queue records who holds a job's lease
    # The pipeline for one video's frames; None: the ingress's own encode -> denoise -> decode.
    generate: Generate | None = None


class VideoJobs(VideoEditJobs):
    """One ingress replica's side of the jobs API: the queue, the results, and this replica's runner."""

    def __init__(self, config: VideoJobsConfig, queue: JobQueue, results: ResultFolder, runner: JobRunner,
                 failures: FailureSorter, clock: Callable[[], float] = time.time, admissions: Admissions | None = None):
        """``admissions``: what the stage replicas admit now (a job none can hold is refused at once)."""
        self.config, self.queue, self.results, self.runner = config, queue, results, runner
        self.failures, self.clock, self.admissions = failures, clock, admissions

    def _started(self) -> None:
        self.runner.start()  # a no-op once started; started here if the app was built without a loop

    async def create(self, request: Request):
        self._started()
        cfg = self.config
        try:
            fields = await read_fields(request, ("input_reference",), MAX_CREATE_BYTES, MAX_REFERENCE_BYTES)
            req = VideoJobRequest.model_validate(fields)
            return await self._queued(job_params(req, cfg.facts, cfg.limits, cfg.model_id, cfg.loras))
        except ValidationError as exc:
            return errors.validation_error(exc)
        except FieldError as exc:
            return errors.field_error(exc)

    async def _queued(self, params: JobParams, source: bytes | None = None) -> JSONResponse:
        """A new job of ``params`` (an edit's: with its ``source`` video, kept beside its results), once the
        stage replicas could hold it (else :class:`FieldError`)."""
        cfg = self.config
        if self.admissions is not None:
            refusal = memory_refusal(cfg.facts, await self.admissions(), params_spec(params, "create"))
            if refusal is not None:  # a job's length is asked in seconds
                raise FieldError("seconds" if refusal.param == "num_frames" else refusal.param, refusal.message)
        now = self.clock()
        job_id = new_job_id(now)
        if source is not None:  # before the job exists: a runner may claim it at once
            await asyncio.to_thread(self.results.put_source, job_id, source)
            if params.extends:
                logger.info("job %s extends a video (%d B) of %d frames by %d from its last, at %dx%d, %d fps",
                            job_id, len(source), params.source_frames, params.num_frames - 1, params.width,
                            params.height, params.fps)
            else:
                logger.info("job %s edits %s (%d B) at strength %g: %d of %d steps on %d frames at %dx%d", job_id,
                            params.remixed_from or "an uploaded video", len(source), params.strength,
                            params_spec(params, job_id).run_steps, params.steps, params.num_frames, params.width,
                            params.height)
        try:
            job = await self.queue.create(new_job(job_id, cfg.model_id, params, int(now)))
        except BaseException:
            if source is not None:
                await asyncio.to_thread(self.results.delete_source, job_id)
            raise
        self.runner.wake()
        return JSONResponse(job.to_json())

    async def _job(self, video_id: str) -> VideoJob | JSONResponse:
        job = await self.queue.get(video_id) if JOB_ID.match(video_id) else None
        if job is None:
            return errors.error_json(404, f"no video {video_id!r} (never created, deleted, or expired)", "video_id",
                                     "video_not_found", "invalid_request_error")
        return job

    async def retrieve(self, request: Request, video_id: str):
        self._started()
        job = await self._job(video_id)
        if isinstance(job, JSONResponse):
            return job
        headers = {}
        if job.status in (JobStatus.QUEUED, JobStatus.IN_PROGRESS):
            headers["openai-poll-after-ms"] = str(self.config.args.poll_after_ms)
        return JSONResponse(job.to_json(), headers=headers)

    async def list(self, request: Request):
        self._started()
        query = request.query_params
        try:
            after = query.get("after")
            if after is not None and not JOB_ID.match(after):
                raise FieldError("after", f"{after!r} is not a video id")
            limit_text = query.get("limit", "20")
            if not limit_text.isascii() or not limit_text.isdigit() or not 1 <= int(limit_text) <= MAX_LIST_LIMIT:
                raise FieldError("limit", f"{limit_text!r} is not a whole number from 1 to {MAX_LIST_LIMIT}")
            order_text = query.get("order", ListOrder.DESC.value)
            if order_text not in {o.value for o in ListOrder}:
                raise FieldError("order", f"{order_text!r} is not 'asc' or 'desc'")
        except FieldError as exc:
            return errors.field_error(exc)
        page = await self.queue.list(after, int(limit_text), ListOrder(order_text))
        data = [job.to_json() for job in page.jobs]
        return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
                "last_id": data[-1]["id"] if data else None, "has_more": page.has_more}

    async def content(self, request: Request, video_id: str):
        self._started()
        name = request.query_params.get("variant", Variant.VIDEO.value)
        if name not in {v.value for v in Variant}:
            return errors.field_error(FieldError("variant", f"{name!r} is not available; this server keeps "
                                                            "'video' (mp4), 'thumbnail' (png) and 'spritesheet' (jpeg)"))
        job = await self._job(video_id)
        if isinstance(job, JSONResponse):
            return job
        if job.status is not JobStatus.COMPLETED or job.result_key is None:
            return errors.error_json(409, f"video {video_id} is {job.status.value}; its content exists once it "
                                          "is completed", "video_id", "video_not_ready", "invalid_request_error")
        variant = Variant(name)
        data = await asyncio.to_thread(self.results.get, job.result_key, variant)
        if data is None:
            return errors.error_json(404, f"the {variant.value} of {video_id} is gone (expired or deleted)",
                                     "video_id", "video_not_found", "invalid_request_error")
        return Response(data, media_type=variant.media_type)

    async def delete(self, request: Request, video_id: str):
        self._started()
        job = await self.queue.delete(video_id) if JOB_ID.match(video_id) else None
        if job is None:
            return (await self._job(video_id))  # the 404
        if job.status is JobStatus.IN_PROGRESS:
            # Here at once if this replica runs it; another replica's runner sees it at its next step.
            self.runner.cancel(job.id)
        return {"id": job.id, "object": "video.deleted", "deleted": True}


def mount(api: FastAPI, config: VideoJobsConfig, backend: JobsBackend, generate, retry_after_s: float,
          failures: FailureSorter, admissions: Admissions | None = None) -> VideoJobs:
    """Add the Videos API to ``api`` and start this replica's runner; ``generate`` is the
    synchronous routes' drive (``Service.generate``), used unless the backend brings its own;
    ``failures``: the ingress's sorting of failed calls (the stage pipeline's);
    ``admissions``: the stage replicas' (``Service.admissions``), checked when a job is created."""

    async def frames(spec, on_progress):
        return (await generate(spec, on_progress)).frames[0]

    runner = JobRunner(backend.queue, backend.results, backend.generate or frames, backend.owner, config.args,
                       retry_after_s, failures)
    jobs = VideoJobs(config, backend.queue, backend.results, runner, failures, admissions=admissions)
    api.include_router(router)
    api.state.video_jobs = jobs
    runner.start()
    return jobs


def current_jobs(request: Request) -> VideoJobs:
    """The serving app's :class:`VideoJobs` (set by :func:`mount`)."""
    return request.app.state.video_jobs


def _store_unavailable(exc: Exception) -> JSONResponse:
    logger.warning("job queue call failed (%s: %s); 503", type(exc).__name__, exc)
    return errors.error_json(503, "the job queue is restarting; retry", None, "store_unavailable", "overloaded",
                             {"Retry-After": "1"})


async def _answer(jobs: VideoJobs, call):
    """A route's answer; a queue that is restarting (its actor died and Ray restarts it) is a 503."""
    try:
        return await call
    except Exception as exc:
        if jobs.failures(exc).kind is FailureKind.LOST_REPLICA:
            return _store_unavailable(exc)
        raise


@router.post(CREATE)
async def create_video(request: Request, jobs: VideoJobs = Depends(current_jobs)):
    return await _answer(jobs, jobs.create(request))


@router.post(VIDEO_EDITS)
async def edit_video(request: Request, jobs: VideoJobs = Depends(current_jobs)):
    return await _answer(jobs, jobs.remix(request))


@router.post(VIDEO_EXTENSIONS)
async def extend_video(request: Request, jobs: VideoJobs = Depends(current_jobs)):
    return await _answer(jobs, jobs.extend(request))


@router.post("/v1/videos/{video_id}/remix")
async def remix_video(request: Request, video_id: str, jobs: VideoJobs = Depends(current_jobs)):
    return await _answer(jobs, jobs.remix(request, video_id))


@router.get("/v1/videos")
async def list_videos(request: Request, jobs: VideoJobs = Depends(current_jobs)):
    return await _answer(jobs, jobs.list(request))


@router.get("/v1/videos/{video_id}")
async def retrieve_video(request: Request, video_id: str, jobs: VideoJobs = Depends(current_jobs)):
    return await _answer(jobs, jobs.retrieve(request, video_id))


@router.get("/v1/videos/{video_id}/content")
async def video_content(request: Request, video_id: str, jobs: VideoJobs = Depends(current_jobs)):
    return await _answer(jobs, jobs.content(request, video_id))


@router.delete("/v1/videos/{video_id}")
async def delete_video(request: Request, video_id: str, jobs: VideoJobs = Depends(current_jobs)):
    return await _answer(jobs, jobs.delete(request, video_id))
