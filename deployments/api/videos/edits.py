"""Video edits as jobs: the bodies of ``POST /v1/videos/{id}/remix``, ``POST /v1/videos/edits`` and
``POST /v1/videos/extensions``, to :class:`JobParams`.

A remix (OpenAI's ``videos.remix(video_id, prompt=...)``) edits a completed job's video toward a new prompt;
``POST /v1/videos/edits`` (``videos.edit(prompt=..., video=...)``) edits an uploaded video
(:mod:`deployments.api.videos.uploads` checks it), or names a completed one as ``{"id": ...}``, which is its
remix. Either runs the family's video-to-video pipeline (``WanVideoToVideoPipeline``) over the source's frames.

- A remix keeps its source's size, length, frame rate, steps, guidance, negative prompt, seed and LoRA
  adapter (:func:`remix_base`); an upload gives its size (or ``size``'s), its frames (or ``seconds``' of them)
  and its frame rate, and the rest are the server's defaults (:func:`upload_base`).
- The body's extras override those; ``strength`` (0-1, the pipeline's default 0.8) is how far the edit may
  go from the source (:func:`edit_params`).

An extension (OpenAI's ``videos.extend(prompt=..., seconds=..., video=...)``) goes on from a video's last frame
for ``seconds`` more, on the families that make a video from an image (``video-extend``): the family's
image-to-video generation from that frame, after the source's frames (:func:`extend_params`).

Run by the ingress replica.
"""
from __future__ import annotations

import base64
import dataclasses
from dataclasses import dataclass
from typing import Sequence

from pydantic import BaseModel, ConfigDict, Field

from deployments.api.schemas import MAX_USER_CHARS, Text
from deployments.api.videos.create import format_seconds, frames_for
from deployments.api.videos.protocol import VideoRequest, video_spec
from deployments.api.videos.uploads import SourceShape
from deployments.capacity.request_limits import FieldError, Limits
from deployments.jobs.records import JobParams, VideoJob
from deployments.models.families import FamilyTraits
from deployments.models.lora_rows import MAX_LORA_SCALE, ServedLora

DEFAULT_STRENGTH = 0.8  # WanVideoToVideoPipeline's default


class _VideoJobEdit(BaseModel):
    """What every video edit's body takes: OpenAI's ``prompt`` and ``video``, and this project's extras."""

    model_config = ConfigDict(extra="forbid")

    prompt: Text
    model: Text | None = None
    user: Text | None = Field(None, max_length=MAX_USER_CHARS)  # accepted and ignored
    # The uploaded file's bytes, or {"id": "video_..."} (edit_jobs reads which).
    video: object | None = None
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    num_inference_steps: int | None = Field(None, ge=1)
    guidance_scale: float | None = Field(None, ge=0.0, le=100.0)
    negative_prompt: Text | None = None
    lora: Text | None = Field(None, max_length=128)
    lora_scale: float | None = Field(None, ge=-MAX_LORA_SCALE, le=MAX_LORA_SCALE)


class VideoEditRequest(_VideoJobEdit):
    """A remix's or an edit's body: ``seconds`` and ``size`` for an upload, and how far to go from it."""

    seconds: Text | None = None  # an upload: how much of it to edit; a remix keeps its source's (400)
    size: Text | None = None  # an upload: the size to edit it at; a remix keeps its source's (400)
    strength: float = Field(DEFAULT_STRENGTH, gt=0.0, le=1.0)


@dataclass(frozen=True)
class EditBase:
    """What an edit keeps unless its body says otherwise (None: the server's default)."""

    width: int
    height: int
    num_frames: int
    fps: int
    steps: int | None = None
    guidance_scale: float | None = None
    negative_prompt: str | None = None
    seed: int | None = None
    lora: str | None = None
    lora_scale: float | None = None


def check_video_edits(facts: FamilyTraits) -> None:
    """:class:`FieldError` naming ``model`` unless the family edits videos (``video-edit`` in ``/v1/models``)."""
    if "video-edit" not in facts.modalities:
        raise FieldError("model", f"the {facts.family.value} model family does not edit videos (it makes "
                                  f"{', '.join(facts.modalities)}); POST /v1/videos makes one from text")


def remix_base(req: VideoEditRequest, source: VideoJob, limits: Limits) -> EditBase:
    """A completed job's parameters, or :class:`FieldError` for a body that asks to change what a remix keeps,
    or a source longer than one request may be (an extension's)."""
    was = source.params
    for name, kept in (("seconds", was.seconds), ("size", f"{was.width}x{was.height}")):
        if getattr(req, name) is not None:
            raise FieldError(name, f"a remix keeps its source's {name} ({kept}); POST /v1/videos makes another")
    if was.video_frames > limits.max_frames:
        raise FieldError("video_id", f"{source.id} has {was.video_frames} frames; this server edits at most "
                                     f"{limits.max_frames} at once")
    return EditBase(was.width, was.height, was.video_frames, was.fps, was.steps, was.guidance_scale,
                    was.negative_prompt, was.seed, was.lora, None if was.lora is None else was.lora_scale)


def upload_base(req: VideoEditRequest, shape: SourceShape, facts: FamilyTraits) -> EditBase:
    """An uploaded video's size and frame rate, and its frames: all that decode (up to the configured most), or
    ``seconds``' of them, as the VAE takes them (1 + a multiple of its temporal factor)."""
    t = facts.temporal_factor
    usable = 1 + (shape.frames - 1) // t * t
    frames = usable if req.seconds is None else frames_for(req.seconds, shape.fps, t)
    if frames > usable:
        raise FieldError("seconds", f"{req.seconds} s at the video's {shape.fps} fps is {frames} frames; it has "
                                    f"{shape.frames} that this server edits, so at most "
                                    f"{format_seconds(usable, shape.fps)} s")
    return EditBase(shape.width, shape.height, frames, shape.fps)


def edit_params(req: VideoEditRequest, base: EditBase, facts: FamilyTraits, limits: Limits, model_id: str,
                loras: Sequence[ServedLora] = (), remixed_from: str | None = None) -> JobParams:
    """The edit job's parameters: ``base`` with the body's prompt and extras over it, or :class:`FieldError`
    naming the first bad field. The job's source video is kept beside its results, not in these."""
    check_video_edits(facts)
    given = req.model_dump(exclude_unset=True)
    as_sync = VideoRequest(
        prompt=req.prompt, model=req.model, size=f"{base.width}x{base.height}", seed=given.get("seed", base.seed),
        num_inference_steps=given.get("num_inference_steps", base.steps),
        guidance_scale=given.get("guidance_scale", base.guidance_scale),
        negative_prompt=given.get("negative_prompt", base.negative_prompt), num_frames=base.num_frames,
        fps=base.fps, **_lora(given, base))
    spec = dataclasses.replace(video_spec(as_sync, facts, limits, model_id, None, loras), strength=req.strength,
                               edit_rule=facts.edit_rule)
    if spec.run_steps < 1:  # the video2video rule enters at steps - int(steps * strength)
        raise FieldError("strength", f"{req.strength} of {spec.steps} steps runs no denoising step; use at least "
                                     f"{1 / spec.steps:.3g}, or more steps")
    return JobParams(spec.prompt, spec.negative_prompt, spec.width, spec.height, spec.num_frames, base.fps, spec.steps,
                     spec.guidance_scale, spec.seed, format_seconds(spec.num_frames, base.fps), None, spec.lora,
                     spec.lora_scale, source_video=True, strength=req.strength, remixed_from=remixed_from)


def _lora(given: dict, base: EditBase) -> dict:
    """The edit's adapter: the base's at its scale, unless the request names one (at its configured scale
    unless it gives one) or only a scale."""
    if "lora" in given:
        return {"lora": given["lora"], "lora_scale": given.get("lora_scale")}
    return {"lora": base.lora, "lora_scale": given.get("lora_scale", base.lora_scale)}


# The runner holds an extension's whole video as 8-bit frames: twice the frames one request makes (162 frames of
# 832x480 at the default 81: 194 MB) bounds what one job makes it hold.
EXTENDED_SOURCE_FRAMES = 2


class VideoExtendRequest(_VideoJobEdit):
    """An extension's body: OpenAI's ``seconds``, the new part's length."""

    seconds: Text


@dataclass(frozen=True)
class ExtendedSource:
    """What an extension goes on from: its source's size, frame rate and frames, and its last frame as PNG."""

    width: int
    height: int
    fps: int
    frames: int
    last_frame: bytes = dataclasses.field(repr=False)


def check_video_extends(facts: FamilyTraits) -> None:
    """:class:`FieldError` naming ``model`` unless the family extends videos (``video-extend`` in ``/v1/models``)."""
    if "video-extend" not in facts.modalities:
        raise FieldError("model", f"the {facts.family.value} model family does not extend videos (it makes "
                                  f"{', '.join(facts.modalities)}): an extension is an image-to-video generation "
                                  "from the video's last frame")


def extend_params(req: VideoExtendRequest, source: ExtendedSource, facts: FamilyTraits, limits: Limits,
                  model_id: str, loras: Sequence[ServedLora] = ()) -> JobParams:
    """The extension job's parameters: ``seconds`` more at the source's size and frame rate, from its last frame,
    or :class:`FieldError` naming the first bad field. The source video is kept beside the job's results."""
    check_video_extends(facts)
    frames = frames_for(req.seconds, source.fps, facts.temporal_factor)
    as_sync = VideoRequest(prompt=req.prompt, model=req.model, size=f"{source.width}x{source.height}", seed=req.seed,
                           num_inference_steps=req.num_inference_steps, guidance_scale=req.guidance_scale,
                           negative_prompt=req.negative_prompt, num_frames=frames, fps=source.fps, lora=req.lora,
                           lora_scale=req.lora_scale)
    try:
        spec = video_spec(as_sync, facts, limits, model_id, source.last_frame, loras)
    except FieldError as exc:
        if exc.param != "num_frames":
            raise
        raise FieldError("seconds", f"{req.seconds} s at the video's {source.fps} fps is {frames} frames; this "
                                    f"server makes at most {limits.max_frames} at once") from None
    total = source.frames + spec.num_frames - 1
    return JobParams(spec.prompt, spec.negative_prompt, spec.width, spec.height, spec.num_frames, source.fps,
                     spec.steps, spec.guidance_scale, spec.seed, format_seconds(total, source.fps),
                     base64.b64encode(source.last_frame).decode(), spec.lora, spec.lora_scale, source_video=True,
                     extends=True, source_frames=source.frames)
