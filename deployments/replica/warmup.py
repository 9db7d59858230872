"""A stage replica's warm-up: measure, then plan again from the measurements.

A replica first plans with what it can know before running anything (layer bytes, its share of the
GPU, its link, 0 s of compute, no working set), leases and applies that plan so its weights can
run. Then one warm-up phase, on the replica's own device with the plan applied:

1. the activation model is calibrated (``deployments.models.activation_features``: two small shapes per regime,
   1 step each, measured by ``offload_core.residency.activation_meter``);
2. one 1-step call at the deployment's default request shape (``limits.default_size``, and
   ``default_frames`` for a family that makes videos; n = 1) runs with timing hooks on every layer
   (``offload_core.planner.measured_compute``: compute only, a streamed layer's wait for its copy excluded).

Cost (the replica's start-up; each call leases and runs like a request): 2 calibration calls per
regime (4 for Wan, 2 for Flux) at 32x32 and 64x64 (a few ms each on the tiny zoo) plus one step
at the default shape, which is what one denoising step of a default request costs (on Wan2.1-14B
at 1280x720x81, two transformer passes: tens of seconds on one GPU; the encoder and the VAE run
their call once). The timed call runs without the CPU's live-bytes dispatch mode, which slows
every op, so its times are compute, not bookkeeping.

The stage is then planned again with the measured compute per layer and, as its working set, the
predicted activation peak of the default request at the stage's batch (the Denoiser's max_batch,
1 elsewhere) with ``ACTIVATION_MARGIN``, at most what leaves the leanest plan room. A plan whose
decisions differ is applied in place of the first (standing lease grown before anything new is
allocated, shrunk after the old residency's bytes are gone); an equal one keeps the applied
residency and its report shows the re-predicted figures.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import time
from dataclasses import dataclass
from typing import ContextManager, Mapping, Protocol

import torch
from torch import nn

from cluster.replica.ledger_view import ReplicaMemory
from cluster.replica.plan import replan_stage
from deployments.capacity.request_limits import Limits, parse_size
from deployments.models import activation_features, families, tiled_activations, vae_tiling
from deployments.models.families import FamilyTraits
from deployments.replica.batching import BatchingConfig
from deployments.replica.stage_residency import StageResidency
from deployments.wire.spec import GenerationSpec, PipelineStage
from offload_core.planner.activation_model import ACTIVATION_MARGIN
from offload_core.planner.measured_compute import (
    MeasuredCompute,
    WarmupFigures,
    seconds_per_parameter,
    with_estimates,
)
from offload_core.planner.search import PipelinePlan, repredict
from offload_core.residency.activation_meter import measure_activations
from offload_core.residency.compute_meter import LayerTiming

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class WarmupShape:
    """The deployment's default request: what a replica times its layers at and sizes its working set for."""

    width: int
    height: int
    frames: int  # default_frames for a family that makes videos, 1 for image-only families

    @classmethod
    def default_for(cls, limits: Limits, facts: FamilyTraits) -> WarmupShape:
        width, height = parse_size(limits.default_size, facts, limits)  # a default the API would refuse fails here
        return cls(width, height, limits.default_frames if facts.supports_video else 1)

    def spec(self, facts: FamilyTraits, n: int = 1) -> GenerationSpec:
        """One step (more when a family's experts need them all to run: Wan2.2 A14B), ``n`` outputs, the
        family's default guidance (Wan: both guidance passes run)."""
        return GenerationSpec(f"warmup-{self.width}x{self.height}x{self.frames}", families.warmup_prompt(facts), None,
                              self.height, self.width, self.frames, families.warmup_steps(facts),
                              facts.default_guidance, 0, n)

    def describe(self) -> str:
        return f"{self.width}x{self.height}x{self.frames}"


class WarmupSettings(Protocol):
    """The stage's configuration, as far as the warm-up reads it."""

    facts: FamilyTraits
    stage: PipelineStage
    dtype: str
    batching: BatchingConfig | None
    warmup_shape: WarmupShape | None


class WarmupHost(Protocol):
    """What the warm-up reads from the stage's worker and runs its calls through; it changes nothing
    there: the worker applies the :class:`WarmupOutcome` (its activations, its final plan)."""

    replica: str
    config: WarmupSettings
    pipe: object
    device: torch.device
    memory: ReplicaMemory
    residency: StageResidency

    def in_use(self, activation_bytes: int = 0) -> ContextManager[None]: ...

    def activation_room(self) -> int: ...


@dataclass(frozen=True)
class WarmupOutcome:
    """What the warm-up measured and decided (logged once, kept by the worker for tests and reports)."""

    shape: WarmupShape
    batch: int  # requests the working set is sized for
    compute: tuple[tuple[str, MeasuredCompute], ...]  # per component
    predicted_activation_bytes: int  # the default request at ``batch``, before the margin
    working_set_bytes: int  # what the plan keeps free of weights (margin applied, capped)
    changes: tuple[str, ...]  # how the final plan differs from the provisional one (empty: kept)
    seconds: float  # the whole warm-up: calibration, the timed call, the replan (the worker adds its re-apply)
    calibration_s: float  # of it, the activation calibration (what a replica paid before it planned from measurements)
    activations: activation_features.StageActivations  # the calibrated model: what calls lease from then on
    plan: PipelinePlan  # changes: the plan to apply in place of the first; else the applied one, re-predicted
    note: str  # why the plan is what it is (the measured compute, the working set), for the log


def warm_up(host: WarmupHost, modules: Mapping[str, nn.Module], provisional: PipelinePlan) -> WarmupOutcome:
    """Calibrate, time, replan against ``provisional`` (the plan as first planned, before the host
    re-tiered it); returns what it measured and decided for the worker to apply."""
    start = time.perf_counter()
    config = host.config
    activations = calibrate_activations(host, modules)
    calibrated_s = time.perf_counter() - start
    shape = config.warmup_shape or WarmupShape.default_for(Limits(), config.facts)
    compute = with_unrun_estimated(host.replica, time_layers(host, modules, shape.spec(config.facts), activations),
                                   provisional)
    batch = config.batching.max_batch if config.batching is not None else 1
    predicted = activations.predict(shape.spec(config.facts, n=batch))
    plan = replan_stage(provisional, host.memory, compute=compute,
                        working_set_bytes=math.ceil(ACTIVATION_MARGIN * predicted))
    working_set = plan.device_capacity - plan.weight_budget
    changes = plan.changes_from(provisional)
    steps = shape.spec(config.facts).steps
    note = (f"planned from a warm-up at {shape.describe()} ({steps} step{'s' if steps > 1 else ''}): compute per use "
            + ", ".join(f"{name} {m.per_use_s * 1e3:.2f} ms" for name, m in compute.items())
            + f"; working set {working_set} B = {ACTIVATION_MARGIN} x {predicted} B of predicted activations for "
            f"{batch} request(s)" + (" (capped: the leanest plan's weights need the rest)"
                                     if working_set < math.ceil(ACTIVATION_MARGIN * predicted) else ""))
    final = (dataclasses.replace(plan, notes=(*plan.notes, note)) if changes
             else repredict(host.residency.plan, plan.facts, (note,)))
    return WarmupOutcome(shape, batch, tuple(compute.items()), predicted, working_set, changes,
                         time.perf_counter() - start, calibrated_s, activations, final, note)


def calibrate_activations(worker: WarmupHost, modules: Mapping[str, nn.Module]) -> activation_features.StageActivations:
    """Measure the stage's activation peak on two small shapes per regime, on the replica's device, and
    fit the family's model (deployments/models/activation_features.py); calls lease it from then on."""
    facts, stage = worker.config.facts, worker.config.stage

    def measure(spec: GenerationSpec) -> int:
        value = activation_features.stage_input(worker.pipe, facts, stage, spec)
        with worker.in_use():  # the weights as prepared for the call (resident layers bound) are not its activations
            weights = [t for m in modules.values() for t in (*m.parameters(), *m.buffers())]
            _, measured = measure_activations(
                lambda: activation_features.run_stage(worker.pipe, facts, stage, spec, worker.device, value),
                worker.device, weights)
        return measured.peak_bytes

    start = time.perf_counter()
    dtype_bytes = getattr(torch, worker.config.dtype).itemsize
    tile = vae_tiling.tile_side(worker.pipe.vae) if stage is PipelineStage.DECODE else None
    shapes = activation_features.calibration_shapes(facts, stage=stage, tile=tile)
    fitted = activation_features.calibrate_stage(facts, stage, shapes, measure, dtype_bytes)
    if tile is not None:  # outputs beyond the tile decode in two phases, each calibrated on its own
        tiled = tiled_activations.calibrate_tiled(facts, worker.pipe.vae, set(fitted.models), measure, dtype_bytes)
        fitted = activation_features.StageActivations(facts, stage, {**fitted.models, **tiled}, tile)
    logger.info("%s: activations calibrated in %.2f s on %s: %s", worker.replica, time.perf_counter() - start,
                worker.device, fitted.explain())
    return fitted


def time_layers(worker: WarmupHost, modules: Mapping[str, nn.Module], spec: GenerationSpec,
                activations: activation_features.StageActivations) -> dict[str, MeasuredCompute]:
    """Compute per use of every component, timed on one call at ``spec`` under the applied plan (its
    call lease: the calibrated activations' prediction, margin applied, at most the room left)."""
    facts, stage = worker.config.facts, worker.config.stage
    value = activation_features.stage_input(worker.pipe, facts, stage, spec)
    lease = min(math.ceil(ACTIVATION_MARGIN * activations.predict(spec)), worker.activation_room())
    # The hooks (and the copy log) from before the use is prepared: preparing it issues the first layers'
    # copies, which a one-pass call (the Denoiser's joined branches at one step) would otherwise not show.
    with LayerTiming(modules, device=worker.device) as timing:
        with worker.in_use(lease), torch.no_grad():
            activation_features.run_stage(worker.pipe, facts, stage, spec, worker.device, value)
    figures = timing.figures()
    # The uses the timed call made: the Denoiser's stepper runs guidance's two branches as one use (twice
    # the rows; activation_features.denoise_as_served), Wan's VAE decodes frame by frame inside one use.
    uses = families.uses_per_request(facts, stage, spec.steps, spec.guidance_scale, batched=True)
    return {name: _per_use(figures[name], uses[name]) for name in modules}


def with_unrun_estimated(replica: str, compute: Mapping[str, MeasuredCompute],
                         plan: PipelinePlan) -> dict[str, MeasuredCompute]:
    """``compute`` with an estimate for every layer the timed call never ran (a component the request
    did not use: a glyph encoder without quoted text, an expert before its boundary step), from the
    component's meta facts: its declared layer order, the cost model's compute at the seconds per
    parameter measured here. Logged once per such component; the worker times it on first use."""
    profiles = {p.name: p for p in plan.facts.components}
    rate = seconds_per_parameter(tuple(profiles.values()), compute)
    out = {}
    for name, measured in compute.items():
        out[name] = with_estimates(profiles[name], measured, rate) if name in profiles else measured
        if measured.estimated:
            logger.info("%s: %s: the warm-up did not run %d of its %d layers (%s); planned from its meta facts: "
                        "declared order, %.3f ms per use estimated at %.3g ns per parameter measured on this "
                        "device; timed on the first call that runs it", replica, name, len(measured.estimated),
                        len(profiles[name].layers), ", ".join(measured.estimated[:3]),
                        out[name].per_use_s * 1e3, (seconds_per_parameter((profiles[name],), {name: measured})
                                                    or rate) * 1e9)
    return out


def _per_use(figures: WarmupFigures, uses: int) -> MeasuredCompute:
    """Seconds per use as the planner counts uses (``uses`` in the timed call): the hooks count passes
    over the first layer, which may be more (Wan's VAE: one per latent frame) or fewer."""
    uses = max(uses, 1)
    if not figures.order and not figures.unrun:
        # No layer groups: the pipeline calls a method (vae.decode), so the hooks sit on its children.
        return MeasuredCompute((), figures.total_s / uses)
    # Waits for copies come along: the plan's picture shows the measured pass with them.
    return MeasuredCompute.of(figures).scaled(figures.uses / uses)


__all__ = ["WarmupHost", "WarmupOutcome", "WarmupShape", "warm_up"]
