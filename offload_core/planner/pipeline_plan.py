"""The plan: per component how its weights are kept, and what the planner predicts it costs.

A plan is frozen and explainable (``explain()`` gives one line per decision with its numbers).
It configures the engine directly (``ComponentPlan.streaming_config()``), so nothing downstream
reads loose flags. Users pin fields by hand with :class:`ComponentOverride`.

Runs in whichever process plans: ``offload-serve plan`` and each stage replica (through ``cluster/replica/plan.py``).
"""
from __future__ import annotations

import enum
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from offload_core.buffers import DEFAULT_STAGING_BUFFERS
from offload_core.host.tier import STAGED_TIERS, HostingTier
from offload_core.planner.facts import PipelineFacts, Stage
from offload_core.planner.strategy import Strategy
from offload_core.planner.window import WINDOW_TOLERANCE
from offload_core.quant import WeightFormat

GiB = 1024**3


class PerformanceMode(enum.Enum):
    # Everything resident: no copies at all; needs the whole pipeline to fit on the device.
    SPEED = "speed"
    # The least device memory: every component streamed (or model-offloaded), nothing resident,
    # non-layer weights parked between uses, big token tables gathered on the host.
    MEMORY = "memory"
    # The fastest plan that stays within half the device (or the memory plan, if that is bigger):
    # leaves room for activations of larger requests and for neighbours on a shared GPU.
    BALANCED = "balanced"
    # The fastest plan that fits the device; the default.
    AUTO = "auto"


@dataclass(frozen=True)
class ComponentOverride:
    """Fields of one component's plan pinned by hand; None leaves the field to the planner."""

    strategy: Strategy | None = None
    resident_layers: int | None = None
    prefetch_depth: int | None = None
    park: bool | None = None
    host_tables: bool | None = None
    hosting: HostingTier | None = None  # one tier for every layer of the component

    def __post_init__(self) -> None:
        if self.resident_layers is not None and self.resident_layers < 0:
            raise ValueError(f"resident_layers must be >= 0, got {self.resident_layers}")
        if self.prefetch_depth is not None and self.prefetch_depth < 1:
            raise ValueError(f"prefetch_depth must be >= 1, got {self.prefetch_depth}")

    def describe(self) -> str:
        """The fields pinned, as a config names them (``prefetch_depth=1, hosting=mapped``)."""
        pinned = [f"{name}={value.value if isinstance(value, enum.Enum) else value}"
                  for name, value in asdict(self).items() if value is not None]
        return ", ".join(pinned) or "nothing pinned"


@dataclass(frozen=True)
class ComponentPrediction:
    """What the cost model predicts for one component, per request."""

    in_use_bytes: int  # device weight bytes at peak while its stage runs (non-layer + resident + slots)
    idle_bytes: int  # device weight bytes while other stages run
    bytes_moved: int  # host->device bytes per request
    transfer_s: float  # time those copies take on the link
    compute_s: float  # compute per request (all uses)
    time_s: float  # compute plus the transfer time not hidden behind it
    parked: bool  # the parking gate is predicted to park its non-layer weights between uses
    staging_bytes: int = 0  # pinned host staging buffers for its PAGEABLE and MAPPED layers
    # Host bytes of its streamed layers as hosted, and as loaded: they differ under FP8 weights.
    layer_host_bytes: int = 0
    layer_native_bytes: int = 0
    # The prefetch window (layerwise): its device bytes and the fewest/most streamed layers it holds.
    window_bytes: int = 0
    window_layers: tuple[int, int] = (0, 0)
    # Per use, what the window makes compute wait beyond max(copy, compute) (planner.window's replay),
    # and what depth 1 would: above 0 for an uneven stack the window cannot bank copies ahead for.
    window_wait_s: float = 0.0
    window_shallow_wait_s: float = 0.0
    window_bound_s: float = 0.0  # the use's bound: max(its copies, its compute)


@dataclass(frozen=True)
class ComponentPlan:
    """How one component keeps its weights."""

    name: str
    strategy: Strategy
    layer_groups: tuple[str, ...]
    resident_layers: int  # the leading layers in execution order
    prefetch_depth: int
    park: bool  # park non-layer weights between uses (headroom-gated at run time)
    host_tables: bool  # gather qualifying token tables on the host
    hosting: tuple[tuple[str, HostingTier], ...]  # per layer key; empty unless LAYERWISE
    prediction: ComponentPrediction | None = None
    uses_per_request: int = 1  # from the facts: ranks the component's claim on pins
    weights: WeightFormat = WeightFormat.NATIVE  # from the facts: how LAYERWISE layers are hosted and copied
    # Staging buffers for its PAGEABLE and MAPPED layers (StreamingConfig.staging_buffers), each the
    # largest staged layer's host bytes: more than two where an uneven stack needs them
    # (planner.staging_ring), and why, with the numbers (empty: nothing staged or not looked at).
    staging_buffers: int = DEFAULT_STAGING_BUFFERS
    staging_why: str = ""
    # Threads each staging fill splits over (StreamingConfig.copier_threads): the link's, which
    # measured the staged rate the plan prices PAGEABLE and MAPPED layers at with as many.
    copier_threads: int = 1

    def decisions(self) -> tuple:
        """What the engine is configured from (no predictions): equal decisions run the same way."""
        return (self.strategy, self.layer_groups, self.resident_layers, self.prefetch_depth, self.park,
                self.host_tables, self.hosting, self.weights, self.staging_buffers, self.copier_threads)

    def explain(self) -> str:
        p = self.prediction
        what = {
            Strategy.RESIDENT: "resident",
            Strategy.MODEL_OFFLOAD: "model offload (in for its stage, out after)",
            Strategy.LAYERWISE: (f"layerwise: {self.resident_layers}/{len(self.hosting)} layers resident, "
                                 f"depth {self.prefetch_depth}, "
                                 + ", ".join(f"{n} {t.value}" for t, n in _tier_counts(self.hosting).items() if n)),
        }[self.strategy]
        parked = p.parked if p is not None else self.park
        extras = [x for x, on in (("parked between uses", parked), ("parking gated off: headroom ample", self.park and not parked),
                                  ("tables on host", self.host_tables)) if on]
        if self.strategy is Strategy.LAYERWISE and self.weights is not WeightFormat.NATIVE and p is not None:
            extras.append(f"{self.weights.value} weights: layers host {_gib(p.layer_host_bytes)} "
                          f"instead of {_gib(p.layer_native_bytes)}")
        line = f"{self.name}: {what}" + (f"; {', '.join(extras)}" if extras else "")
        if p is not None and p.window_bytes:
            fewest, most = p.window_layers
            line += (f" | prefetch window {_gib(p.window_bytes)} in bytes: {fewest}-{most} layers, the next "
                     "issued as each layer's kernels launch")
            if p.window_wait_s > WINDOW_TOLERANCE * p.window_bound_s:
                line += (f"; too narrow for its uneven layers: each use waits {p.window_wait_s:.4f} s for copies "
                         "it could not bank ahead")
            elif p.window_shallow_wait_s > WINDOW_TOLERANCE * p.window_bound_s and self.prefetch_depth > 1:
                line += (f"; depth {self.prefetch_depth} banks the copy-bound layers' copies ahead during the "
                         f"compute-bound ones (at depth 1 each use would wait {p.window_shallow_wait_s:.4f} s)")
        if self.staging_why:
            line += f" | {self.staging_why}"
        if any(tier in STAGED_TIERS for _, tier in self.hosting):
            line += f" | staging fills split over {self.copier_threads} copier threads"
        if p is not None:
            line += (f" | device {_gib(p.in_use_bytes)} in use, {_gib(p.idle_bytes)} idle | moves "
                     f"{_gib(p.bytes_moved)}/request in {p.transfer_s:.3f} s | {p.time_s:.3f} s "
                     f"({p.compute_s:.3f} s compute)")
        return line


def _tier_counts(hosting) -> dict[HostingTier, int]:
    counts = {tier: 0 for tier in HostingTier}
    for _, tier in hosting:
        counts[tier] += 1
    return counts


def _tiers_text(hosting) -> str:
    return ", ".join(f"{n} {t.value}" for t, n in _tier_counts(hosting).items() if n) or "none"


def _gib(nbytes: int) -> str:
    return f"{nbytes / GiB:.2f} GiB"


@dataclass(frozen=True)
class PipelinePlan:
    """One plan for a whole pipeline, with its predictions and the reasons behind it."""

    mode: PerformanceMode
    components: tuple[ComponentPlan, ...]
    stages: tuple[Stage, ...]
    device_name: str
    device_capacity: int
    weight_budget: int  # capacity minus the working set: what weights may take
    peak_device_bytes: int  # predicted: max over stages of in-use + the others' idle bytes
    peak_stage: str
    bytes_moved_per_request: int
    transfer_s_per_request: float
    compute_s_per_request: float
    time_s_per_request: float
    pinned_bytes: int  # host bytes the plan page-locks: PINNED layers and staging buffers
    feasible: bool
    park_fraction: float  # the parking gate's fraction of headroom, as predicted and as run
    notes: tuple[str, ...] = field(default=())
    # The facts the plan was made from: a change after planning (the host re-tiering layers)
    # re-predicts from them (``search.retier``), so the plan reported is always the plan that runs.
    facts: PipelineFacts | None = field(default=None, compare=False, repr=False)
    staging_bytes: int = 0  # of pinned_bytes, the staging buffers PAGEABLE and MAPPED layers copy through

    def component(self, name: str) -> ComponentPlan:
        for c in self.components:
            if c.name == name:
                return c
        raise KeyError(f"plan has no component {name!r}; it has {[c.name for c in self.components]}")

    def stage_of(self, component: str) -> Stage:
        for stage in self.stages:
            if component in stage.components:
                return stage
        raise KeyError(component)

    def changes_from(self, other: PipelinePlan) -> tuple[str, ...]:
        """How this plan's decisions differ from ``other``'s, one line per difference (empty: none)."""
        out = [f"mode {other.mode.value} -> {self.mode.value}"] if self.mode is not other.mode else []
        theirs = {c.name: c for c in other.components}
        for c in self.components:
            was = theirs.get(c.name)
            if was is None:
                out.append(f"{c.name}: new")
                continue
            for label, old, new in (("strategy", was.strategy.value, c.strategy.value),
                                    ("resident layers", was.resident_layers, c.resident_layers),
                                    ("depth", was.prefetch_depth, c.prefetch_depth), ("park", was.park, c.park),
                                    ("tables on host", was.host_tables, c.host_tables)):
                if old != new:
                    out.append(f"{c.name}: {label} {old} -> {new}")
            if was.hosting != c.hosting:
                out.append(f"{c.name}: tiers {_tiers_text(was.hosting)} -> {_tiers_text(c.hosting)}")
        out += [f"{name}: gone" for name in theirs if name not in {c.name for c in self.components}]
        return tuple(out)

    def explain(self) -> tuple[str, ...]:
        working_set = self.device_capacity - self.weight_budget
        head = (f"{self.mode.value} plan on {self.device_name} ({_gib(self.device_capacity)}, "
                f"{_gib(working_set)} kept for activations, weights may take {_gib(self.weight_budget)}): {'feasible' if self.feasible else 'INFEASIBLE'}; predicted peak "
                f"{_gib(self.peak_device_bytes)} in stage {self.peak_stage}; {_gib(self.bytes_moved_per_request)} "
                f"moved and {self.time_s_per_request:.2f} s per request ({self.compute_s_per_request:.2f} s compute, "
                f"{self.transfer_s_per_request:.2f} s transfer); {_gib(self.pinned_bytes)} pinned "
                f"({_gib(self.staging_bytes)} of it staging)")
        link = (self.facts.link.explain(),) if self.facts is not None else ()
        return (head, *(c.explain() for c in self.components), *link, *self.notes)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: enums as their values."""
        def plain(value):
            if isinstance(value, enum.Enum):
                return value.value
            if isinstance(value, dict):
                return {k: plain(v) for k, v in value.items()}
            if isinstance(value, (list, tuple)):
                return [plain(v) for v in value]
            return value

        out = plain(asdict(replace(self, facts=None)))
        del out["facts"]  # inputs, not the plan; large for real models
        for comp, plan in zip(out["components"], self.components):
            comp["hosting"] = {t.value: n for t, n in _tier_counts(plan.hosting).items()}
        return out
