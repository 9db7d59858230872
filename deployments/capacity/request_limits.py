"""What one request may ask for (``args.limits``), the size a request names, and the error for a field beyond them.

Read by the ingress (the request bodies' checks) and by every stage replica (its warm-up shape is the
deployment's ``default_size``); :class:`FieldError` is how a bad field is named, answered by the
ingress as a 4xx JSON error.
"""
from __future__ import annotations

import enum
import math
import re

from pydantic import BaseModel, ConfigDict, Field

from deployments.models.families import FamilyTraits

# ASCII digits only, matched in full: "\d" would take full-width and Arabic-Indic digits, and "$"
# a trailing newline.
SIZE_PATTERN = re.compile(r"([0-9]{1,5})x([0-9]{1,5})", re.ASCII)

class FieldError(ValueError):
    """One invalid request field: ``param`` names it (OpenAI's error.param), ``status`` is the 4xx."""

    def __init__(self, param: str, message: str, status: int = 400, code: str = "invalid_value"):
        super().__init__(f"{param}: {message}")
        self.param, self.message, self.status, self.code = param, message, status, code


class Quality(str, enum.Enum):
    """OpenAI's image ``quality``: gpt-image's auto, low, medium and high, DALL·E 3's standard and hd. A
    diffusion model's quality dial is its denoising steps: :meth:`Limits.steps_for`."""

    AUTO = "auto"
    LOW = "low"
    MEDIUM = "medium"
    HIGH = "high"
    STANDARD = "standard"  # DALL·E 3's default: as auto
    HD = "hd"  # DALL·E 3's finer one: as high


class Limits(BaseModel):
    """What one request may ask for; anything beyond is a 400 naming the field."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # The widest image or video a request may ask for, in pixels.
    max_width: int = Field(1024, ge=1)
    # The tallest, in pixels.
    max_height: int = Field(1024, ge=1)
    # The most denoising steps (num_inference_steps).
    max_steps: int = Field(50, ge=1)
    # The most images per request (n).
    max_n: int = Field(4, ge=1)
    # The longest prompt, in characters.
    max_prompt_chars: int = Field(2000, ge=1)
    # The most video frames (num_frames, or seconds x fps + 1).
    max_frames: int = Field(81, ge=1)
    # The size of a request that names none or asks "auto"; also the shape each replica warms up on.
    default_size: str = "256x256"
    # The steps of a request that names none.
    default_steps: int = Field(20, ge=1)
    # The frames of a video request that names none; also the warm-up's frames.
    default_frames: int = Field(9, ge=1)
    # The frames per second of a video that names none (POST /v1/videos: seconds x fps + 1 frames).
    default_fps: int = Field(8, ge=1)
    # An image request's quality "low" as a share of default_steps (rounded up, at least the model's fewest
    # steps); "auto" and DALL·E 3's "standard" are default_steps. num_inference_steps, if given, wins.
    quality_low: float = Field(0.5, gt=0.0, le=4.0)
    # Quality "medium", the same way.
    quality_medium: float = Field(0.75, gt=0.0, le=4.0)
    # Quality "high" (and DALL·E 3's "hd"), the same way, at most max_steps.
    quality_high: float = Field(1.0, gt=0.0, le=4.0)

    def steps_for(self, quality: Quality, fewest: int = 1) -> int:
        """The denoising steps of a request at ``quality`` that names none; ``fewest``: the model's minimum."""
        share = {Quality.LOW: self.quality_low, Quality.MEDIUM: self.quality_medium, Quality.HIGH: self.quality_high,
                 Quality.HD: self.quality_high}.get(Quality(quality))
        if share is None:
            return self.default_steps
        return min(self.max_steps, max(fewest, math.ceil(share * self.default_steps)))


def parse_size(size: str, facts: FamilyTraits, limits: Limits) -> tuple[int, int]:
    match = SIZE_PATTERN.fullmatch(size)
    if not match:
        raise FieldError("size", f"{size!r} is not of the form WIDTHxHEIGHT, e.g. '256x256'")
    width, height = int(match.group(1)), int(match.group(2))
    if width > limits.max_width or height > limits.max_height:
        raise FieldError("size", f"{width}x{height} exceeds the configured maximum "
                                 f"{limits.max_width}x{limits.max_height}")
    m = facts.size_multiple
    if width < m or height < m or width % m or height % m:
        raise FieldError("size", f"width and height must be positive multiples of {m} for this model "
                                 f"(VAE factor x patch size), got {width}x{height}")
    return width, height
