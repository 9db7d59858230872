"""``POST /v1/images/edits``: OpenAI's image edits, run as diffusers' img2img (deployments/models/edits.py).

The official client's ``images.edit`` posts multipart/form-data: ``image`` a file (``image[]`` when it is
given a list: one image per edit, or up to the family's ``max_images``, which Qwen-Image-Edit-2509 composes in
context; the first sets ``size: auto``), the other fields strings. JSON with ``image`` as a data URL works
too. This project's extra ``strength`` (0-1, the img2img pipelines' default 0.6) is how far the edit may
go from the image: the image is noised to the step ``strength`` from the end of ``num_inference_steps``'
schedule, and only those steps run; FLUX.1 Kontext (``EditRule.IN_CONTEXT``) takes the image in context instead,
runs every step and takes no ``strength``. ``size`` absent or ``auto``: the image's own size, rounded down to
the model's multiple. ``mask`` (inpainting, on the families whose ``/v1/models`` lists ``image-inpaint``):
OpenAI's, a PNG of the image's size whose fully transparent pixels mark where to edit. Every other field is
``/v1/images/generations``' (``n``, ``output_format``, ``stream`` with ``partial_images``, the extras);
a stream's images are OpenAI's edit events, ``image_edit.partial_image`` and ``image_edit.completed``.
Run by the ingress replica.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

from fastapi import APIRouter, Request
from pydantic import Field

from deployments.api.body import read_fields
from deployments.api.images.protocol import ImageRequest, image_spec
from deployments.api.reference_images import MAX_REFERENCE_BYTES, has_alpha, image_size
from deployments.api.rendering import ImageRendering, ImageStream
from deployments.api.schemas import reference_bytes
from deployments.api.service import Service
from deployments.capacity.request_limits import FieldError, Limits, parse_size
from deployments.models.families import FamilyTraits
from deployments.models.lora_rows import ServedLora
from deployments.wire.spec import EditRule, GenerationSpec

EDITS = "/v1/images/edits"
# Fields and prompts as /v1/images/generations takes them (its JSON bound), beside the image's own bound.
MAX_FIELDS_BYTES = 1024 * 1024
DEFAULT_STRENGTH = 0.6  # FluxImg2ImgPipeline's, StableDiffusion3Img2ImgPipeline's, ... default
MAX_IMAGES = 3  # the most images any family's edit takes (FamilyTraits.max_images: Qwen-Image-Edit-2509's 3)

router = APIRouter()


class ImageEditRequest(ImageRequest):
    # The image to edit: an uploaded file's bytes (multipart), or a data URL (JSON).
    image: object | None = None  # checked by reference_bytes
    mask: object | None = None  # OpenAI's inpainting mask, as the image: checked by checked_mask
    strength: float = Field(DEFAULT_STRENGTH, gt=0.0, le=1.0)


def own_size(image: bytes, facts: FamilyTraits, limits: Limits) -> str:
    """``size`` for an edit that gave none (or ``auto``): the image's size rounded down to the model's multiple."""
    width, height = image_size(image)
    m = facts.size_multiple
    size = f"{width - width % m}x{height - height % m}"
    try:
        parse_size(size, facts, limits)
    except FieldError as exc:
        raise FieldError("image", f"is {width}x{height}, so the edit would be {size}, and {exc.message}; "
                                  "pass 'size' to resize it") from None
    return size


def edit_spec(req: ImageEditRequest, facts: FamilyTraits, limits: Limits, model_id: str,
              loras: Sequence[ServedLora] = ()) -> GenerationSpec:
    """The edit's GenerationSpec, or :class:`FieldError` naming the first bad field."""
    if "image-edit" not in facts.modalities:
        raise FieldError("model", f"the {facts.family.value} model family does not edit images (it makes "
                                  f"{', '.join(facts.modalities)}); POST /v1/images/generations makes one from text")
    if req.mask is not None and "image-inpaint" not in facts.modalities:
        raise FieldError("mask", f"inpainting is not supported by the {facts.family.value} model family: an edit "
                                 "may change the whole image")
    if req.image is None or req.image == []:
        raise FieldError("image", "required: the image to edit (a file in multipart/form-data, or a data URL "
                                  "'data:image/png;base64,...' in JSON)")
    in_context = facts.edit_rule is EditRule.IN_CONTEXT
    if in_context and "strength" in req.model_fields_set:
        raise FieldError("strength", f"the {facts.family.value} model family edits with the image in context: "
                                     "every step runs and the image is never noised, so there is no strength")
    images = [reference_bytes(value, "image") for value in (req.image if isinstance(req.image, list) else [req.image])]
    if len(images) > facts.max_images:
        raise FieldError("image", f"{len(images)} images: the {facts.family.value} model family edits "
                                  + ("one image at a time" if facts.max_images == 1 else
                                     f"at most {facts.max_images} images together"))
    for width, height in map(image_size, images):
        if in_context and min(width, height) < facts.size_multiple:  # fitted by its aspect ratio: 0 px across
            raise FieldError("image", f"is {width}x{height}: the {facts.family.value} model family takes an image "
                                      f"at least {facts.size_multiple} px a side in context")
    image = images[0]
    size = own_size(image, facts, limits) if req.size in (None, "auto") else req.size
    plain = ImageRequest.model_validate({**req.model_dump(exclude={"image", "mask", "strength"}), "size": size})
    spec = image_spec(plain, facts, limits, model_id, loras=loras, edit=True)
    spec = dataclasses.replace(spec, reference_image=image, context_images=tuple(images[1:]),
                               strength=None if in_context else req.strength, edit_rule=facts.edit_rule,
                               mask_image=None if req.mask is None else checked_mask(req.mask, image))
    if spec.run_steps < 1:  # the video2video rule enters at steps - int(steps * strength)
        raise FieldError("strength", f"{req.strength} of {spec.steps} steps runs no denoising step on the "
                                     f"{facts.family.value} model family; use at least {1 / spec.steps:.3g}, or "
                                     "more steps")
    return spec


def checked_mask(value: object, image: bytes) -> bytes:
    """The mask's bytes if it is an image with transparency of the image's size (OpenAI's rule: its fully
    transparent pixels mark where to edit), else a :class:`FieldError` naming ``mask``."""
    mask = reference_bytes(value, "mask")
    if not has_alpha(mask):
        raise FieldError("mask", "has no alpha channel: its fully transparent pixels mark where to edit "
                                 "(a PNG with transparency)")
    (mask_w, mask_h), (image_w, image_h) = image_size(mask), image_size(image)
    if (mask_w, mask_h) != (image_w, image_h):
        raise FieldError("mask", f"is {mask_w}x{mask_h}, the image {image_w}x{image_h}: they must be the same size")
    return mask


async def _fields(request: Request) -> dict:
    # The images (at most MAX_IMAGES, the most any family takes) and a mask.
    fields = await read_fields(request, ("image", "image[]", "mask"), MAX_FIELDS_BYTES,
                               (MAX_IMAGES + 1) * MAX_REFERENCE_BYTES, max_files=MAX_IMAGES + 1, list_fields=("image[]",))
    if "image[]" in fields:  # the official client's list form
        if "image" in fields:
            raise FieldError("image", "send the images as 'image' or as 'image[]', not both")
        images = fields.pop("image[]")
        fields["image"] = images[0] if len(images) == 1 else images
    return fields


@router.post(EDITS)
async def edits(request: Request):
    service: Service = request.app.state.service
    return await service.answer(request, ImageEditRequest, edit_spec,
                                lambda body: ImageRendering(body.output_format, body.output_compression,
                                                            ImageStream.EDIT), read=_fields)
