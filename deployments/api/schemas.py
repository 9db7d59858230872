"""The HTTP request bodies (OpenAI images API + extras) and their checks against the configured limits.

Pydantic checks each field's type and static range; :func:`image_spec` and :func:`video_spec`
check what depends on the configured model and limits. Either way a bad field becomes
:class:`FieldError` naming it, which the ingress answers with a 4xx JSON error (never a 500).
"""
from __future__ import annotations

import dataclasses
import enum
import secrets
import uuid
from typing import Annotated, Literal, Sequence

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from deployments.api.reference_images import ReferenceImageError, check_reference_image, from_data_url
from deployments.capacity.request_limits import FieldError, Limits, Quality, parse_size
from deployments.models.families import FamilyTraits, ReferenceImage
from deployments.models.lora_rows import MAX_LORA_SCALE, ServedLora
from deployments.wire.media import ImageFormat
from deployments.wire.spec import GenerationSpec

# OpenAI does not bound ``user``; it is logged, so it is bounded here.
MAX_USER_CHARS = 256


def _valid_unicode(value: str) -> str:
    """Refuse lone UTF-16 surrogates (JSON "\\ud800"): tokenizers raise TypeError on them, a 500."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"not valid Unicode: {exc.reason} at character {exc.start}") from None
    return value


# Every string field of a request: valid Unicode, or a 400 naming the field.
Text = Annotated[str, AfterValidator(_valid_unicode)]


class _Generation(BaseModel):
    # Unknown fields are errors (a typo like "num_inference_step" must not be silently ignored).
    model_config = ConfigDict(extra="forbid")

    prompt: Text
    model: Text | None = None
    size: Text | None = None
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    num_inference_steps: int | None = Field(None, ge=1)
    guidance_scale: float | None = Field(None, ge=0.0, le=100.0)
    negative_prompt: Text | None = None
    # The step cache (first-block caching): a step whose first-block residual changed by less than
    # this fraction since the request's last full step skips the remaining blocks. 0: off; null:
    # the deployment's default (denoiser.cache_threshold). Lossy when > 0; 0.05-0.15 is the usual range.
    cache_threshold: float | None = Field(None, ge=0.0, le=1.0)
    # A LoRA adapter by its configured name (GET /v1/models lists them; never a path), applied to this
    # request only: requests with other adapters or none share its step batch. null: the base model.
    lora: Text | None = Field(None, max_length=128)
    # The adapter's strength; null: its configured scale. Needs ``lora``.
    lora_scale: float | None = Field(None, ge=-MAX_LORA_SCALE, le=MAX_LORA_SCALE)
    # Server-Sent Events: "progress" events (denoising step k of n), then one "result" event.
    stream: bool = False
    user: Text | None = Field(None, max_length=MAX_USER_CHARS)  # OpenAI's end-user id; accepted and ignored


class Background(str, enum.Enum):
    """OpenAI's gpt-image ``background``: these models make opaque (RGB) images, so "transparent" is a 400."""

    AUTO = "auto"
    OPAQUE = "opaque"
    TRANSPARENT = "transparent"


class ImageRequest(_Generation):
    n: int = Field(1, ge=1)
    response_format: Text = "b64_json"
    # OpenAI's gpt-image fields: the encoding, and JPEG's or WebP's quality (100 keeps the most).
    output_format: ImageFormat = ImageFormat.PNG
    output_compression: int | None = Field(None, ge=0, le=100)
    # The denoising steps a request that names none runs (Limits.steps_for): clients that send gpt-image's
    # default "auto" (or DALL·E 3's "standard") get the deployment's default_steps.
    quality: Quality = Quality.AUTO
    background: Background = Background.AUTO
    # OpenAI's content filtering level: this server filters nothing, at either level (docs/operations.md).
    moderation: Literal["auto", "low"] = "auto"
    # OpenAI's preview images while streaming: each the decoded estimate of the final image at a step
    # spread evenly before the last (GenerationSpec.preview_steps; fewer when there are few steps).
    partial_images: int = Field(0, ge=0, le=3)


class VideoRequest(_Generation):
    num_frames: int | None = Field(None, ge=1)
    fps: int | None = Field(None, ge=1, le=60)
    # "b64_json": JSON with the mp4 in base64; "mp4": the bytes themselves, as video/mp4.
    response_format: Text = "b64_json"
    # Image-to-video's reference image as a data URL ("data:image/png;base64,...").
    input_reference: Text | None = None


def check_model(requested: str | None, model_id: str) -> None:
    if requested is not None and requested != model_id:
        raise FieldError("model", f"unknown model {requested!r}; this server serves {model_id!r} (GET /v1/models)",
                         status=404, code="model_not_found")


def _check_prompt(req: _Generation, facts: FamilyTraits, limits: Limits) -> None:
    if not req.prompt.strip():
        raise FieldError("prompt", "must not be empty")
    if len(req.prompt) > limits.max_prompt_chars:
        raise FieldError("prompt", f"{len(req.prompt)} characters exceeds the limit of {limits.max_prompt_chars}")
    if req.negative_prompt is not None:
        if not facts.supports_negative_prompt:
            raise FieldError("negative_prompt", f"not supported by the {facts.family.value} model family")
        if len(req.negative_prompt) > limits.max_prompt_chars:
            raise FieldError("negative_prompt", f"{len(req.negative_prompt)} characters exceeds the limit "
                                                f"of {limits.max_prompt_chars}")


def with_lora(spec: GenerationSpec, req: _Generation, loras: Sequence[ServedLora]) -> GenerationSpec:
    """``spec`` with the request's adapter and its scale resolved, or :class:`FieldError` naming
    ``lora`` (an unknown name) or ``lora_scale`` (a scale without an adapter)."""
    if req.lora is None:
        if req.lora_scale is not None:
            raise FieldError("lora_scale", "applies to an adapter: name one in 'lora' (GET /v1/models lists them)")
        return spec
    served = {lora.name: lora for lora in loras}
    if req.lora not in served:
        known = ", ".join(sorted(served)) or "none are configured"
        raise FieldError("lora", f"unknown LoRA adapter {req.lora!r}; this server serves: {known} (GET /v1/models)",
                         status=404, code="lora_not_found")
    scale = served[req.lora].scale if req.lora_scale is None else req.lora_scale
    return dataclasses.replace(spec, lora=req.lora, lora_scale=scale)


def _steps(req: _Generation, facts: FamilyTraits, limits: Limits) -> int:
    steps = req.num_inference_steps or limits.steps_for(getattr(req, "quality", Quality.AUTO), facts.min_steps)
    if steps > limits.max_steps:
        raise FieldError("num_inference_steps", f"{steps} exceeds the configured maximum of {limits.max_steps}")
    if steps < facts.min_steps:
        raise FieldError("num_inference_steps", f"{steps} is too few for this model: it needs at least "
                                                f"{facts.min_steps} (its scheduler ends the schedule at "
                                                f"shift_terminal={facts.shift_terminal}, which one step cannot)")
    return steps


def _check_reference(facts: FamilyTraits, reference: bytes | None) -> None:
    if reference is not None and facts.reference_image is ReferenceImage.NONE:
        raise FieldError("input_reference", f"the {facts.family.value} model family generates from text only; "
                                            "it takes no reference image")
    if reference is None and facts.reference_image is ReferenceImage.REQUIRED:
        raise FieldError("input_reference", f"required: the {facts.family.value} model family makes a video from a "
                                            "reference image (multipart file, or a data URL in JSON)")


def _spec(req: _Generation, facts: FamilyTraits, limits: Limits, n: int, frames: int,
          reference: bytes | None = None) -> GenerationSpec:
    _check_prompt(req, facts, limits)
    _check_reference(facts, reference)
    # "auto" (OpenAI's default for its gpt-image models: the model picks) is the configured default.
    width, height = parse_size(limits.default_size if req.size in (None, "auto") else req.size, facts, limits)
    guidance = facts.default_guidance if req.guidance_scale is None else req.guidance_scale
    seed = secrets.randbelow(2**31) if req.seed is None else req.seed
    return GenerationSpec(uuid.uuid4().hex, req.prompt, req.negative_prompt, height, width, frames,
                          _steps(req, facts, limits), guidance, seed, n, reference, req.cache_threshold)


def image_spec(req: ImageRequest, facts: FamilyTraits, limits: Limits, model_id: str,
               reference: bytes | None = None, loras: Sequence[ServedLora] = ()) -> GenerationSpec:
    """``reference``: the checked reference image's bytes (``deployments.api.reference_images``), if any;
    ``loras``: the adapters a request may name."""
    check_model(req.model, model_id)
    if "image" not in facts.modalities:
        raise FieldError("model", f"the {facts.family.value} model family makes {', '.join(facts.modalities)} only; "
                                  "use POST /v1/videos")
    _check_reference(facts, reference)
    if reference is not None and facts.reference_image is ReferenceImage.OPTIONAL:
        raise FieldError("input_reference", f"the {facts.family.value} model family takes a reference image for "
                                            "videos only (POST /v1/videos); an image is made from text")
    if req.response_format != "b64_json":
        raise FieldError("response_format", f"{req.response_format!r} is not supported; use 'b64_json' "
                                            "(this server keeps no files to serve by url)")
    if req.background is Background.TRANSPARENT:
        raise FieldError("background", "'transparent' is not supported: these models make opaque (RGB) images; "
                                       "send 'auto' or 'opaque'")
    if req.output_compression is not None and not req.output_format.lossy:
        raise FieldError("output_compression", f"applies to output_format 'jpeg' or 'webp', not "
                                               f"{req.output_format.value!r} (lossless)")
    if req.partial_images and not req.stream:
        raise FieldError("partial_images", "preview images are sent as events: set 'stream': true with it")
    if req.n > limits.max_n:
        raise FieldError("n", f"{req.n} exceeds the configured maximum of {limits.max_n}")
    if facts.max_n is not None and req.n > facts.max_n:
        raise FieldError("n", f"{req.n} exceeds what the {facts.family.value} model family makes per request "
                              f"({facts.max_n})")
    spec = dataclasses.replace(_spec(req, facts, limits, req.n, 1, reference), partial_images=req.partial_images)
    return with_lora(spec, req, loras)


def reference_bytes(value: object, param: str = "input_reference") -> bytes | None:
    """The checked image of an ``input_reference`` (or an edit's ``image``): a data URL, or the bytes of an
    uploaded file; a :class:`FieldError` naming ``param`` otherwise."""
    if value is None:
        return None
    if not isinstance(value, (bytes, str)):
        raise FieldError(param, f"must be an image file (multipart/form-data) or a data URL string "
                                f"'data:image/png;base64,...', got {type(value).__name__}")
    try:
        return check_reference_image(value) if isinstance(value, bytes) else from_data_url(str(value))
    except ReferenceImageError as exc:
        raise FieldError(param, str(exc)) from None


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
    frames = req.num_frames or limits.default_frames
    if frames > limits.max_frames:
        raise FieldError("num_frames", f"{frames} exceeds the configured maximum of {limits.max_frames}")
    if (frames - 1) % facts.temporal_factor:
        raise FieldError("num_frames", f"must be 1 + a multiple of {facts.temporal_factor} for this model "
                                       f"(its VAE's temporal factor), got {frames}")
    return with_lora(_spec(req, facts, limits, 1, frames, reference), req, loras)
