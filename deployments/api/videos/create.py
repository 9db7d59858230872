"""``POST /v1/videos`` bodies: OpenAI's fields plus this project's extras, to :class:`JobParams`.

The official client posts ``multipart/form-data``, so every field may arrive as a string
(``"seed": "3"``); pydantic's lax mode reads numbers from such strings. ``seconds`` and ``size``
map to frames and resolution: ``seconds`` s at ``fps`` frames per second is ``seconds * fps + 1``
frames (Wan's 81 frames are 5 s at 16 fps), rounded up to what the VAE makes (1 + a multiple of its
temporal factor). Every other check is the synchronous route's (:func:`deployments.api.videos.protocol.video_spec`).
A video edit's body is :mod:`deployments.api.videos.edits`'.
"""
from __future__ import annotations

import base64
import math
import re
from typing import Sequence

from pydantic import BaseModel, ConfigDict, Field, field_validator

from deployments.api.schemas import MAX_USER_CHARS, Text, reference_bytes
from deployments.api.videos.protocol import VideoRequest, video_spec
from deployments.capacity.request_limits import FieldError, Limits
from deployments.jobs.records import JobParams
from deployments.models.families import FamilyTraits
from deployments.models.lora_rows import MAX_LORA_SCALE, ServedLora

# "4", "8", "12" from the official client; fractions allowed ("1.5"), never signs or exponents.
SECONDS_PATTERN = re.compile(r"[0-9]{1,4}(\.[0-9]{1,3})?", re.ASCII)


class VideoJobRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    prompt: Text
    model: Text | None = None
    seconds: Text | None = None
    size: Text | None = None
    # OpenAI's image-to-video reference: the uploaded file's bytes (multipart), or a data URL (JSON).
    input_reference: object | None = None  # checked by reference_bytes: bytes or a data URL string
    user: Text | None = Field(None, max_length=MAX_USER_CHARS)  # OpenAI's end-user id; accepted and ignored
    # This project's extras (the openai client's extra_body).
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    num_inference_steps: int | None = Field(None, ge=1)
    guidance_scale: float | None = Field(None, ge=0.0, le=100.0)
    negative_prompt: Text | None = None
    fps: int | None = Field(None, ge=1, le=60)
    lora: Text | None = Field(None, max_length=128)  # a configured LoRA adapter's name (VideoRequest's)
    lora_scale: float | None = Field(None, ge=-MAX_LORA_SCALE, le=MAX_LORA_SCALE)

    @field_validator("seconds", mode="before")
    @classmethod
    def _seconds_as_text(cls, value):
        # JSON clients may send a number; the video object reports seconds as a string either way.
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
        return value


def format_seconds(frames: int, fps: int) -> str:
    return f"{(frames - 1) / fps:.2f}".rstrip("0").rstrip(".")


def frames_for(seconds: str, fps: int, temporal_factor: int) -> int:
    if not SECONDS_PATTERN.fullmatch(seconds) or float(seconds) <= 0:
        raise FieldError("seconds", f"{seconds!r} is not a positive number of seconds, e.g. '4' or '1.5'")
    intervals = round(float(seconds) * fps)
    return 1 + temporal_factor * max(1, math.ceil(intervals / temporal_factor))


def job_params(req: VideoJobRequest, facts: FamilyTraits, limits: Limits, model_id: str,
               loras: Sequence[ServedLora] = ()) -> JobParams:
    """The job's parameters, or :class:`FieldError` naming the first bad field; ``loras``: the adapters
    a request may name."""
    reference = reference_bytes(req.input_reference)
    fps = req.fps or limits.default_fps
    frames = limits.default_frames if req.seconds is None else frames_for(req.seconds, fps, facts.temporal_factor)
    as_sync = VideoRequest(prompt=req.prompt, model=req.model, size=req.size, seed=req.seed,
                           num_inference_steps=req.num_inference_steps, guidance_scale=req.guidance_scale,
                           negative_prompt=req.negative_prompt, num_frames=frames, fps=fps, lora=req.lora,
                           lora_scale=req.lora_scale)
    try:
        spec = video_spec(as_sync, facts, limits, model_id, reference, loras)
    except FieldError as exc:
        if exc.param != "num_frames":
            raise
        longest = format_seconds(limits.max_frames, fps)
        raise FieldError("seconds", f"{req.seconds} s at {fps} fps is {frames} frames; this server makes at most "
                                    f"{limits.max_frames} frames ({longest} s at {fps} fps)") from None
    return JobParams(spec.prompt, spec.negative_prompt, spec.width, spec.height, spec.num_frames, fps, spec.steps,
                     spec.guidance_scale, spec.seed, format_seconds(spec.num_frames, fps),
                     None if reference is None else base64.b64encode(reference).decode(), spec.lora, spec.lora_scale)

