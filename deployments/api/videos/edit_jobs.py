"""The Videos API's edits: a remix, an edit of an uploaded video, an extension (each a new job).

``POST /v1/videos/{id}/remix`` and ``POST /v1/videos/edits`` edit a completed video's frames, or an uploaded
video's, toward a new prompt; ``POST /v1/videos/extensions`` goes on from a video's last frame. The bodies and
their parameters are :mod:`deployments.api.videos.edits`'; an upload is checked by
:mod:`deployments.api.videos.uploads`. :class:`VideoEditJobs` is mixed into
:class:`deployments.api.videos.jobs.VideoJobs`, which queues the job (``_queued``: the source video kept beside
its results) and routes the calls. Run by the ingress replica.
"""
from __future__ import annotations

import asyncio
import re

from fastapi import Request
from pydantic import ValidationError

from deployments.api import errors
from deployments.api.body import read_fields
from deployments.api.videos.edits import (
    EXTENDED_SOURCE_FRAMES,
    EditBase,
    ExtendedSource,
    VideoEditRequest,
    VideoExtendRequest,
    check_video_edits,
    check_video_extends,
    edit_params,
    extend_params,
    remix_base,
    upload_base,
)
from deployments.api.videos.uploads import MAX_SOURCE_VIDEO_BYTES, check_source_video
from deployments.capacity.request_limits import FieldError
from deployments.jobs.records import JobStatus, VideoJob
from deployments.jobs.results import Variant
from deployments.wire import media

JOB_ID = re.compile(r"^video_[0-9a-f]{24}$")
# Fields and prompts as POST /v1/videos takes them, beside the upload's own bound.
MAX_FIELDS_BYTES = 256 * 1024


class VideoEditJobs:
    """The edit calls of one ingress replica's :class:`deployments.api.videos.jobs.VideoJobs` (its ``config``,
    ``queue``, ``results``, ``_started`` and ``_queued``)."""

    async def remix(self, request: Request, video_id: str | None = None):
        """``POST /v1/videos/{video_id}/remix``; without ``video_id``, ``POST /v1/videos/edits``, whose
        ``video`` is an upload or names a completed video (``{"id": ...}``; ``video[id]`` in a form)."""
        self._started()
        cfg = self.config
        try:
            fields = await read_fields(request, ("video",), MAX_FIELDS_BYTES,
                                       0 if video_id else MAX_SOURCE_VIDEO_BYTES)
            named = named_video(fields)
            req = VideoEditRequest.model_validate(fields)
            check_video_edits(cfg.facts)
            base, source, video_id = await self._edit_source(req, video_id, named)
            params = edit_params(req, base, cfg.facts, cfg.limits, cfg.model_id, cfg.loras, video_id)
            return await self._queued(params, source)
        except ValidationError as exc:
            return errors.validation_error(exc)
        except FieldError as exc:
            return errors.field_error(exc)

    async def _edit_source(self, req: VideoEditRequest, in_path: str | None,
                           named: str | None) -> tuple[EditBase, bytes, str | None]:
        """What an edit starts from: its base, its source's mp4, and the completed video it remixes (None: an
        upload, checked here)."""
        if in_path is not None:
            if named is not None or req.video is not None:
                raise FieldError("video", f"a remix edits the video in its path ({in_path}); send no 'video'")
            named = in_path
        if named is not None:
            job, source = await self._source(named)
            return remix_base(req, job, self.config.limits), source, named
        if not isinstance(req.video, bytes):
            raise FieldError("video", "required: the video to edit, an mp4 file (multipart/form-data), or a "
                                      "completed video of this server as {'id': 'video_...'}")
        shape = await asyncio.to_thread(check_source_video, req.video, req.size, self.config.facts, self.config.limits)
        return upload_base(req, shape, self.config.facts), req.video, None

    async def extend(self, request: Request):
        """``POST /v1/videos/extensions``: ``seconds`` more of a video, uploaded or named as ``{"id": ...}``."""
        self._started()
        cfg = self.config
        try:
            fields = await read_fields(request, ("video",), MAX_FIELDS_BYTES, MAX_SOURCE_VIDEO_BYTES)
            named = named_video(fields)
            req = VideoExtendRequest.model_validate(fields)
            check_video_extends(cfg.facts)
            source, data = await self._extended_source(req, named)
            return await self._queued(extend_params(req, source, cfg.facts, cfg.limits, cfg.model_id, cfg.loras), data)
        except ValidationError as exc:
            return errors.validation_error(exc)
        except FieldError as exc:
            return errors.field_error(exc)

    async def _extended_source(self, req: VideoExtendRequest, named: str | None) -> tuple[ExtendedSource, bytes]:
        """An extension's source (a completed video, or an upload checked here) and its mp4."""
        cfg = self.config
        most = EXTENDED_SOURCE_FRAMES * cfg.limits.max_frames
        if named is not None:
            job, data = await self._source(named)
            p = job.params
            if p.video_frames > most:
                raise FieldError("video", f"{named} has {p.video_frames} frames; this server extends videos of at "
                                          f"most {most}")
            frames, last = await asyncio.to_thread(media.last_frame, data, p.video_frames, (p.width, p.height))
            return ExtendedSource(p.width, p.height, p.fps, frames, media.png_bytes(last)), data
        if not isinstance(req.video, bytes):
            raise FieldError("video", "required: the video to extend, an mp4 file (multipart/form-data), or a "
                                      "completed video of this server as {'id': 'video_...'}")
        shape = await asyncio.to_thread(check_source_video, req.video, None, cfg.facts, cfg.limits, most, True)
        return ExtendedSource(shape.width, shape.height, shape.fps, shape.frames, media.png_bytes(shape.last)), req.video

    async def _source(self, video_id: str) -> tuple[VideoJob, bytes]:
        """An edit's (or extension's) source job and its mp4, or :class:`FieldError` naming ``video_id`` (404:
        none; 409: not completed)."""
        job = await self.queue.get(video_id) if JOB_ID.match(video_id) else None
        if job is None:
            raise FieldError("video_id", f"no video {video_id!r} (never created, deleted, or expired)", 404,
                             "video_not_found")
        if job.status is not JobStatus.COMPLETED or job.result_key is None:
            raise FieldError("video_id", f"video {video_id} is {job.status.value}; an edit or an extension starts "
                                         "from a completed video", 409, "video_not_ready")
        video = await asyncio.to_thread(self.results.get, job.result_key, Variant.VIDEO)
        if video is None:
            raise FieldError("video_id", f"the video of {video_id} is gone (expired or deleted)", 404,
                             "video_not_found")
        return job, video


def named_video(fields: dict) -> str | None:
    """The completed video a body names (``{"id": ...}`` in JSON, ``video[id]`` in a form), taken out of
    ``fields``; None where it names none (an upload, or no video)."""
    in_form = fields.pop("video[id]", None)
    given = fields.get("video")
    if in_form is not None:
        if given is not None:
            raise FieldError("video", "send 'video' or 'video[id]', not both")
        return str(in_form)
    if isinstance(given, dict):
        if set(given) != {"id"} or not isinstance(given["id"], str):
            raise FieldError("video", "names a video as {'id': 'video_...'}, nothing else")
        del fields["video"]
        return given["id"]
    if given is not None and not isinstance(given, bytes):
        raise FieldError("video", f"must be an mp4 file (multipart/form-data) or {{'id': 'video_...'}}, got "
                                  f"{type(given).__name__}")
    return None
