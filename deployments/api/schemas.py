"""What every generation request body shares (OpenAI's images and videos APIs, plus this server's extras) and
the checks against the configured model and limits that they share.

Pydantic checks each field's type and static range; :func:`base_spec` checks what depends on the configured
model and limits, and each endpoint family adds its own (``deployments.api.images.protocol``,
``deployments.api.videos.protocol``). Either way a bad field becomes :class:`FieldError` naming it, which
the ingress answers with a 4xx JSON error (never a 500). Run by the ingress replica.
"""
from __future__ import annotations

import dataclasses
import secrets
import uuid
from typing import Annotated, Sequence

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from deployments.api.reference_images import ReferenceImageError, check_reference_image, from_data_url
from deployments.capacity.request_limits import FieldError, Limits, Quality, parse_size
from deployments.models.families import FamilyTraits, ReferenceImage
from deployments.models.lora_rows import MAX_LORA_SCALE, ServedLora
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


class GenerationRequest(BaseModel):
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


def check_model(requested: str | None, model_id: str) -> None:
    if requested is not None and requested != model_id:
        raise FieldError("model", f"unknown model {requested!r}; this server serves {model_id!r} (GET /v1/models)",
                         status=404, code="model_not_found")


def _check_prompt(req: GenerationRequest, facts: FamilyTraits, limits: Limits) -> None:
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


def with_lora(spec: GenerationSpec, req: GenerationRequest, loras: Sequence[ServedLora]) -> GenerationSpec:
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


def _steps(req: GenerationRequest, facts: FamilyTraits, limits: Limits) -> int:
    steps = req.num_inference_steps or limits.steps_for(getattr(req, "quality", Quality.AUTO), facts.min_steps)
    if steps > limits.max_steps:
        raise FieldError("num_inference_steps", f"{steps} exceeds the configured maximum of {limits.max_steps}")
    if steps < facts.min_steps:
        raise FieldError("num_inference_steps", f"{steps} is too few for this model: it needs at least "
                                                f"{facts.min_steps} (its scheduler ends the schedule at "
                                                f"shift_terminal={facts.shift_terminal}, which one step cannot)")
    return steps


def check_reference(facts: FamilyTraits, reference: bytes | None) -> None:
    if reference is not None and facts.reference_image is ReferenceImage.NONE:
        raise FieldError("input_reference", f"the {facts.family.value} model family generates from text only; "
                                            "it takes no reference image")
    if reference is None and facts.reference_image is ReferenceImage.REQUIRED:
        raise FieldError("input_reference", f"required: the {facts.family.value} model family makes a video from a "
                                            "reference image (multipart file, or a data URL in JSON)")


def base_spec(req: GenerationRequest, facts: FamilyTraits, limits: Limits, n: int, frames: int,
          reference: bytes | None = None) -> GenerationSpec:
    _check_prompt(req, facts, limits)
    check_reference(facts, reference)
    # "auto" (OpenAI's default for its gpt-image models: the model picks) is the configured default.
    width, height = parse_size(limits.default_size if req.size in (None, "auto") else req.size, facts, limits)
    guidance = facts.default_guidance if req.guidance_scale is None else req.guidance_scale
    seed = secrets.randbelow(2**31) if req.seed is None else req.seed
    return GenerationSpec(uuid.uuid4().hex, req.prompt, req.negative_prompt, height, width, frames,
                          _steps(req, facts, limits), guidance, seed, n, reference, req.cache_threshold)


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
