"""The largest request each model accepts, as the service enforces it (``GET /v1/models`` → ``limits``).

Two things bound a request: the configured limits (``args.limits``: max_width, max_height,
max_frames, max_n) and memory: a stage replica refuses a request whose predicted activations could
never fit beside its weights in its share of the GPU (:meth:`deployments.replica.worker.StageWorker.admit`).
Each replica publishes what it admits (:class:`StageAdmission`: its calibrated activation models and
the room its share leaves) to the residency board; :func:`model_limits` intersects the configured
limits with every published replica's admission, through the same :meth:`StageAdmission.admits`
that the replicas refuse with, so the numbers are the ones enforced.

What the four numbers mean (each the largest value whose every smaller step is admitted too):

- ``width`` x ``height``: the largest size at ``default_size``'s aspect ratio (both sides multiples
  of the model's ``size_multiple``), for one image (n=1, one frame). Any size no wider and no
  taller is admitted; the next size up at that aspect is refused.
- ``frames``: the largest video length (1 + a multiple of the VAE's temporal factor) at ``at_size``
  with n=1; 1 for image-only families.
- ``n``: the largest number of images per request at ``at_size`` (one frame).

``at_size`` is ``default_size``, or ``width`` x ``height`` when the default is larger than that.
"""
from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass
from typing import Callable, Sequence

from pydantic import BaseModel, ConfigDict, Field

from deployments.capacity.request_limits import FieldError, Limits
from deployments.models.activation_features import Regime, StageActivations
from deployments.models.families import FamilyTraits
from deployments.wire.spec import GenerationSpec, PipelineStage
from offload_core.planner.activation_model import ActivationModel

CONFIGURED = "configured"  # limited_by: the configured limit binds, not memory
FAMILY = "family"  # limited_by: the model family makes images only (frames = 1)


class LimitSource(str, enum.Enum):
    CONFIGURED = "configured"  # a stage has no replica report yet: the configured limits alone
    MEASURED = "measured"  # every stage has reported: configured limits ∩ every replica's activation room


@dataclass(frozen=True)
class StageAdmission:
    """What one stage replica admits: its calibrated activation models and the room its share leaves
    beside its weights. The replica refuses with :meth:`admits`; the ingress states limits with it."""

    stage: PipelineStage
    room_bytes: int
    models: tuple[tuple[Regime, ActivationModel], ...]
    tile: int | None = None  # the decoder's VAE tiles outputs beyond this side (None: it does not tile)

    def need_bytes(self, facts: FamilyTraits, spec: GenerationSpec) -> int:
        return StageActivations(facts, self.stage, dict(self.models), self.tile).predict(spec)

    def admits(self, facts: FamilyTraits, spec: GenerationSpec) -> bool:
        return self.need_bytes(facts, spec) <= self.room_bytes


class ModelLimits(BaseModel):
    """The largest request the model accepts (the ``limits`` object of each model in ``GET /v1/models``)."""

    model_config = ConfigDict(frozen=True)

    width: int = Field(description="Widest image at default_size's aspect ratio that is admitted (n=1, one "
                                   "frame); with height, any size no wider and no taller is admitted.")
    height: int = Field(description="Height of that largest size (the same aspect ratio).")
    frames: int = Field(description="Most video frames admitted at at_size with n=1 (1 for image-only models).")
    n: int = Field(description="Most images per request admitted at at_size (one frame).")
    at_size: str | None = Field(description="WIDTHxHEIGHT that frames and n are stated at: default_size, or "
                                            "width x height when smaller; null when nothing is admitted.")
    source: LimitSource = Field(description="'configured': some stage has not reported yet, so these are the "
                                            "configured limits alone; 'measured': configured limits intersected "
                                            "with what every stage replica's activation model admits in its share.")
    limited_by: dict[str, str] = Field(description="Per number: 'configured' (the configured maximum binds), "
                                                   "'family' (frames of an image-only model), or the stage whose "
                                                   "activation room binds (encode, denoise, decode).")


def _probe(facts: FamilyTraits, limits: Limits, width: int, height: int, frames: int, n: int,
           image: bytes | None = None) -> GenerationSpec:
    return GenerationSpec("limits", "limits", None, height, width, frames, limits.default_steps,
                          facts.default_guidance, 0, n, image)


def _refusing_stage(admissions: Sequence[StageAdmission], facts: FamilyTraits, spec: GenerationSpec) -> str | None:
    return next((a.stage.value for a in admissions if not a.admits(facts, spec)), None)


def _largest(candidates: Sequence, spec_of: Callable[[object], GenerationSpec], admissions, facts):
    """The last candidate of the admitted prefix (None if the first is refused), and what stops it."""
    best = None
    for candidate in candidates:
        refused_by = _refusing_stage(admissions, facts, spec_of(candidate))
        if refused_by is not None:
            return best, refused_by
        best = candidate
    return best, CONFIGURED


def _sizes(facts: FamilyTraits, limits: Limits, aspect: tuple[int, int]) -> list[tuple[int, int]]:
    """Sizes at ``aspect`` (width, height), multiples of size_multiple, within the configured maxima."""
    m, (aw, ah) = facts.size_multiple, aspect
    sizes = []
    for width in range(m, limits.max_width + 1, m):
        height = (width * ah // aw) // m * m
        if height > limits.max_height:
            break
        if height >= m:
            sizes.append((width, height))
    return sizes


def _aspect(limits: Limits) -> tuple[int, int]:
    width, _, height = limits.default_size.partition("x")
    return int(width), int(height)


def model_limits(facts: FamilyTraits, limits: Limits, admissions: Sequence[StageAdmission],
                 image: bytes | None = None) -> ModelLimits:
    """Configured limits ∩ what every reporting replica admits; 'configured' until every stage reported.
    ``image``: each probe carries it (an in-context edit's image adds its tokens to every Denoiser step)."""
    measured = {a.stage for a in admissions} >= set(PipelineStage)
    admissions = tuple(admissions) if measured else ()
    default = _aspect(limits)

    def probe(width: int, height: int, frames: int, n: int) -> GenerationSpec:
        return _probe(facts, limits, width, height, frames, n, image)

    size, size_by = _largest(_sizes(facts, limits, default), lambda s: probe(*s, 1, 1), admissions, facts)
    if size is None:
        return ModelLimits(width=0, height=0, frames=0, n=0, at_size=None,
                           source=LimitSource.MEASURED if measured else LimitSource.CONFIGURED,
                           limited_by={"width": size_by, "height": size_by, "frames": size_by, "n": size_by})
    at = default if default[0] <= size[0] and default[1] <= size[1] else size
    frames, frames_by = 1, FAMILY
    if facts.supports_video:
        lengths = range(1 + facts.temporal_factor, limits.max_frames + 1, facts.temporal_factor)
        longest, frames_by = _largest(lengths, lambda f: probe(*at, f, 1), admissions, facts)
        frames = longest or 1
    n, n_by = _largest(range(1, limits.max_n + 1), lambda k: probe(*at, 1, k), admissions, facts)
    return ModelLimits(width=size[0], height=size[1], frames=frames, n=n or 0, at_size=f"{at[0]}x{at[1]}",
                       source=LimitSource.MEASURED if measured else LimitSource.CONFIGURED,
                       limited_by={"width": size_by, "height": size_by, "frames": frames_by, "n": n_by})


def size_text(nbytes: int) -> str:
    """Bytes for a message: GiB from 1 GiB up, else MiB (a tiny model's activations are MiB)."""
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.2f} MiB"


@dataclass(frozen=True)
class Nearest:
    """The largest requests like a refused one that a replica admits, each changing one thing."""

    size: tuple[int, int] | None  # the largest size at its aspect (same frames and n); None: none
    frames: int | None  # the most frames at its size and n (videos only); None: none, or an image
    n: int | None  # the most images at its size and frames; None: none

    def param(self, spec: GenerationSpec) -> str:
        """The field to name: n or num_frames when lowering it alone is what the request needs, else size."""
        if spec.n > 1 and self.n is not None:
            return "n"
        if spec.num_frames > 1 and self.frames is not None:
            return "num_frames"
        return "size"

    def describe(self, spec: GenerationSpec) -> str:
        """"size 16x16 at the same frames and n, or 65 frames at this size": the axes the request varies."""
        parts = [f"size {self.size[0]}x{self.size[1]} at the same frames and n" if self.size
                 else "no size at this aspect with the same frames and n"]
        if spec.num_frames > 1:
            parts.append(f"{self.frames} frames at this size" if self.frames else "no video at this size")
        if spec.n > 1:
            parts.append(f"n={self.n} at this size" if self.n else "not even n=1 at this size")
        return "the largest it admits like this request: " + ", or ".join(parts)


def _last_admitted(admission: StageAdmission, facts: FamilyTraits, specs) -> GenerationSpec | None:
    best = None
    for spec in specs:
        if not admission.admits(facts, spec):
            break
        best = spec
    return best


def nearest_admitted(admission: StageAdmission, facts: FamilyTraits, spec: GenerationSpec) -> Nearest:
    """What ``admission`` admits along each of the request's axes (for its refusal to name); not bounded by
    the configured limits (the ingress checked those)."""
    m = facts.size_multiple
    sizes = [dataclasses.replace(spec, width=w, height=(w * spec.height // spec.width) // m * m)
             for w in range(m, spec.width + 1, m) if (w * spec.height // spec.width) // m * m >= m]
    size = _last_admitted(admission, facts, sizes)
    frames = None
    if spec.num_frames > 1:
        lengths = [dataclasses.replace(spec, num_frames=f)
                   for f in range(1 + facts.temporal_factor, spec.num_frames + 1, facts.temporal_factor)]
        frames = _last_admitted(admission, facts, lengths)
    n = _last_admitted(admission, facts, [dataclasses.replace(spec, n=k) for k in range(1, spec.n + 1)])
    return Nearest(None if size is None else (size.width, size.height),
                   None if frames is None else frames.num_frames, None if n is None else n.n)


def memory_refusal(facts: FamilyTraits, admissions: Sequence[StageAdmission], spec: GenerationSpec) -> FieldError | None:
    """The 4xx for a request some stage replica can never hold (as that replica would refuse it), or None.

    For the ingress, where a refusal would otherwise come only when the request reaches that stage
    (a video job: after it was accepted, as a failed job)."""
    for admission in admissions:
        if admission.admits(facts, spec):
            continue
        nearest = nearest_admitted(admission, facts, spec)
        return FieldError(nearest.param(spec), (
            f"{spec.width}x{spec.height}x{spec.num_frames} (n={spec.n}) needs "
            f"{size_text(admission.need_bytes(facts, spec))} of activations in the {admission.stage.value} stage; "
            f"this deployment serves at most {size_text(admission.room_bytes)} there; {nearest.describe(spec)}; "
            "GET /v1/models states the limits"))
    return None
