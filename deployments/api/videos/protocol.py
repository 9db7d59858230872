"""``POST /v1/videos/generations``' body (a video in one synchronous request, this server's own) and the
checks every video request shares (``POST /v1/videos``' bodies extend it: ``deployments.api.videos.create``).

Run by the ingress replica.
"""
from __future__ import annotations

from typing import Sequence

from pydantic import Field

from deployments.api.schemas import (
    GenerationRequest,
    Text,
    base_spec,
    check_model,
    reference_bytes,
    with_lora,
)
from deployments.capacity.request_limits import FieldError, Limits
from deployments.models.families import FamilyTraits
from deployments.models.lora_rows import ServedLora
from deployments.wire.spec import GenerationSpec


class VideoRequest(GenerationRequest):
    num_frames: int | None = Field(None, ge=1)
    fps: int | None = Field(None, ge=1, le=60)
    # "b64_json": JSON with the mp4 in base64; "mp4": the bytes themselves, as video/mp4.
    response_format: Text = "b64_json"
    # Image-to-video's reference image as a data URL ("data:image/png;base64,...").
    input_reference: Text | None = None


def video_spec(req: VideoRequest, facts: FamilyTraits, limits: Limits, model_id: str,
               reference: bytes | None = None, loras: Sequence[ServedLora] = ()) -> GenerationSpec:
    """``reference``: the checked reference image's bytes (``deployments.api.reference_images``), if
    any; else the request's own ``input_reference`` data URL, checked here."""
    check_model(req.model, model_id)
    if reference is None:
        reference = reference_bytes(req.input_reference)
    if not facts.supports_video:
        raise FieldError("model", f"the {facts.family.value} model family makes images only; "
                                  "use POST /v1/images/generations")
    if req.response_format not in ("b64_json", "mp4"):
        raise FieldError("response_format", f"{req.response_format!r} is not supported; use 'b64_json' or 'mp4'")
    if req.stream and req.response_format == "mp4":
        raise FieldError("stream", "a stream of events carries JSON; use response_format 'b64_json' with stream")
    frames = req.num_frames or limits.default_frames
    if frames > limits.max_frames:
        raise FieldError("num_frames", f"{frames} exceeds the configured maximum of {limits.max_frames}")
    if (frames - 1) % facts.temporal_factor:
        raise FieldError("num_frames", f"must be 1 + a multiple of {facts.temporal_factor} for this model "
                                       f"(its VAE's temporal factor), got {frames}")
    return with_lora(base_spec(req, facts, limits, 1, frames, reference), req, loras)
