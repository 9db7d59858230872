"""``POST /v1/images/generations``' and ``/v1/images/edits``' body (OpenAI's images API, gpt-image's fields
included, plus this server's extras) and its checks against the configured model and limits.

Run by the ingress replica.
"""
from __future__ import annotations

import dataclasses
import enum
from typing import Literal, Sequence

from pydantic import Field

from deployments.api.schemas import GenerationRequest, Text, base_spec, check_model, check_reference, with_lora
from deployments.capacity.request_limits import FieldError, Limits, Quality
from deployments.models.families import FamilyTraits, ReferenceImage
from deployments.models.lora_rows import ServedLora
from deployments.wire.media import ImageFormat
from deployments.wire.spec import GenerationSpec


class Background(str, enum.Enum):
    """OpenAI's gpt-image ``background``: these models make opaque (RGB) images, so "transparent" is a 400."""

    AUTO = "auto"
    OPAQUE = "opaque"
    TRANSPARENT = "transparent"


class ImageRequest(GenerationRequest):
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


def image_spec(req: ImageRequest, facts: FamilyTraits, limits: Limits, model_id: str,
               reference: bytes | None = None, loras: Sequence[ServedLora] = (), edit: bool = False) -> GenerationSpec:
    """``reference``: the checked reference image's bytes (``deployments.api.reference_images``), if any;
    ``loras``: the adapters a request may name; ``edit``: the body of an edit (its route checked the image)."""
    check_model(req.model, model_id)
    if "image" not in facts.modalities and not edit:
        where = "/v1/images/edits with the image to edit" if "image-edit" in facts.modalities else "/v1/videos"
        raise FieldError("model", f"the {facts.family.value} model family makes {', '.join(facts.modalities)} only; "
                                  f"use POST {where}")
    check_reference(facts, reference)
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
    spec = dataclasses.replace(base_spec(req, facts, limits, req.n, 1, reference), partial_images=req.partial_images)
    return with_lora(spec, req, loras)
