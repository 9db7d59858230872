"""``GET /v1/models``: OpenAI's model object plus the largest request this service accepts of it.

The numbers are :func:`deployments.capacity.admission.model_limits`: the configured limits
intersected with what every reporting stage replica admits. Runs in the ingress replica.
"""
from __future__ import annotations

import functools
import io
from typing import Sequence

from pydantic import BaseModel, ConfigDict, Field

from deployments.capacity.admission import ModelLimits, StageAdmission, model_limits
from deployments.capacity.request_limits import Limits, Quality
from deployments.models.families import FamilyTraits
from deployments.models.lora_rows import ServedLora
from deployments.wire.spec import EditRule


class LoraCard(BaseModel):
    """One configured LoRA adapter: its name and default scale (never its path)."""

    model_config = ConfigDict(frozen=True)

    name: str
    scale: float


class ModelCard(BaseModel):
    """One model in ``GET /v1/models``: OpenAI's model object plus what this service serves of it."""

    model_config = ConfigDict(frozen=True)

    id: str
    object: str = "model"
    created: int = 0
    owned_by: str = "offload-serve"
    family: str = Field(description="the model family (deployments/models/): wan, wan-i2v, flux, ...")
    modalities: list[str] = Field(description="what the family makes: image, image-edit, image-inpaint, video, "
                                  "video-edit, image-to-video, video-extend")
    size_multiple: int = Field(description="Width and height must be multiples of this.")
    min_steps: int = Field(1, description="The fewest num_inference_steps the model's schedule makes finite "
                                          "(2 where its scheduler sets shift_terminal: Qwen-Image).")
    max_images: int = Field(1, description="The most images an edit takes ('image[]'): 1, or 3 for a family "
                                           "that composes several in context (Qwen-Image-Edit-2509/2511).")
    limits: ModelLimits
    edit_limits: ModelLimits | None = Field(None, description="A family that edits with the image in context and "
                                            "also makes images from text (FLUX.1 Kontext): the largest edit "
                                            "admitted, its image about a megapixel (4096 tokens beside the "
                                            "output's in every step); null for every other family.")
    quality_steps: dict[str, int] = Field(default_factory=dict, description="The denoising steps an image request "
                                          "at each OpenAI quality runs when it names none (auto: default_steps).")
    configured_limits: Limits = Field(description="The configured limits and defaults (args.limits).")
    serving: bool = Field(True, description="Every stage deployment has a running replica; false: requests "
                          "for this model get 503 with Retry-After until it does (not_serving says why).")
    not_serving: str | None = Field(None, description="Which stage is down and Serve's reason, while serving "
                                    "is false.")
    loras: list[LoraCard] = Field(default_factory=list, description="The LoRA adapters a request may name in "
                                  "'lora' (extra_body), with the scale it gets without 'lora_scale'.")


class ModelList(BaseModel):
    model_config = ConfigDict(frozen=True)

    object: str = "list"
    data: list[ModelCard]


@functools.lru_cache(maxsize=1)
def square_image() -> bytes:
    """A 16x16 PNG: an in-context edit family fits any square image to its square megapixel (4096 tokens)."""
    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (16, 16), (128, 128, 128)).save(out, format="PNG")
    return out.getvalue()


def model_card(model_id: str, facts: FamilyTraits, limits: Limits,
               admissions: Sequence[StageAdmission], loras: Sequence[ServedLora] = ()) -> ModelCard:
    # An edit-only family's probes count its image already (a request without one is priced as a square's).
    in_context_too = facts.edit_rule is EditRule.IN_CONTEXT and "image" in facts.modalities
    return ModelCard(id=model_id, family=facts.family.value, modalities=list(facts.modalities),
                     size_multiple=facts.size_multiple, min_steps=facts.min_steps, max_images=facts.max_images,
                     limits=model_limits(facts, limits, admissions), configured_limits=limits,
                     edit_limits=model_limits(facts, limits, admissions, square_image()) if in_context_too else None,
                     quality_steps={q.value: limits.steps_for(q, facts.min_steps) for q in Quality},
                     loras=[LoraCard(name=lora.name, scale=lora.scale) for lora in loras])
