"""One pass over a component's layers, as spans on the copy and compute streams: predicted or measured.

Predicted: the cost model's facts (per-layer compute, the link's pinned and pageable rates, the
plan's resident layers, depth and tiers) run through the engine's own issue rule, in steady state:
``prepare_for_use`` issues the first ``slots`` copies; the pre-hook of streamed layer j issues the
copy of layer j + slots - 1 (wrapping into the next use); a layer computes once its copy landed
and the layer before it finished. A PINNED layer is one DMA on the copy stream; a PAGEABLE or
MAPPED one is first copied into one of the two pinned staging buffers by the host copier thread
(at the pageable rate), then DMA'd. The third of three simulated passes is shown: the first pays
``prepare_for_use``'s burst, later ones are the steady state a long request runs in.

Measured: a running replica's warm-up (``residency.compute_meter``) keeps its last pass over each
component's layers as it ran (:func:`recorded_timeline`): on the compute stream each layer's
compute, the time in its hooks outside compute (the streamer's wait for its copy, or on CPU the
synchronous copy it issues) and the non-layer compute between; on the copy stream the copy that fed
each streamed layer, timed on the copy stream itself (CUDA timing events), so a copy that hides
behind compute is seen to. Without a recorded pass (figures from before it was kept),
:func:`measured_timeline` lays the per-use means out in order on the compute stream alone.

Pure arithmetic on frozen facts: the planner's CLI and a replica (for ``/v1/residency/picture``)
both run it; nothing here touches a device.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Sequence

from offload_core.buffers import slot_count
from offload_core.host.tier import STAGED_TIERS, HostingTier
from offload_core.planner.facts import ComponentProfile, LinkFacts
from offload_core.planner.measured_compute import RecordedPass
from offload_core.planner.pipeline_plan import ComponentPlan
from offload_core.planner.strategy import Strategy

# The host copier fills two staging buffers ahead (streaming/staging.py): a third staged layer
# waits for the first one's DMA to land.
STAGING_BUFFERS = 2
# Passes simulated: the first holds prepare_for_use's burst of copies; the third is the steady state.
_PASSES = 3


class Lane(enum.Enum):
    """Where a span runs."""

    STAGING = "host copier"  # memcpy of a PAGEABLE or MAPPED layer into a pinned staging buffer
    COPY = "copy stream"  # host->device DMA
    COMPUTE = "compute stream"


class SpanKind(enum.Enum):
    STAGE = "staging memcpy"
    COPY = "copy"
    COMPUTE = "layer compute"
    REST = "non-layer compute"
    WAIT = "waiting for a copy"  # measured: the layer's hooks outside its compute


class TimelineSource(enum.Enum):
    PREDICTED = "predicted"
    MEASURED = "measured (warm-up)"


@dataclass(frozen=True)
class Span:
    lane: Lane
    kind: SpanKind
    layer: str  # layer key; "" for non-layer compute or a whole-component copy
    start_s: float  # from the start of the pass
    end_s: float
    tier: HostingTier | None = None  # of a copy


@dataclass(frozen=True)
class Timeline:
    """One pass over a component's layers (one forward: a denoising step's, or the encoder's call)."""

    component: str
    source: TimelineSource
    spans: tuple[Span, ...]
    pass_s: float  # from the pass's first compute to its last; copies issued in the pass before start < 0

    def lane(self, lane: Lane) -> tuple[Span, ...]:
        return tuple(s for s in self.spans if s.lane is lane)

    def busy_s(self, lane: Lane) -> float:
        return sum(s.end_s - s.start_s for s in self.lane(lane))


def predicted_timeline(profile: ComponentProfile, plan: ComponentPlan, link: LinkFacts) -> Timeline:
    """The steady-state pass of ``plan`` over ``profile``'s layers (see the module docstring)."""
    rest = profile.compute_s_rest
    if plan.strategy is not Strategy.LAYERWISE:
        return _unstreamed(profile, plan, link)
    r = min(plan.resident_layers, len(profile.layers))
    resident, streamed = profile.layers[:r], profile.layers[r:]
    tiers = dict(plan.hosting)
    slots = slot_count(plan.prefetch_depth, len(streamed))
    n = len(streamed)
    # Global index j = pass * n + i over the streamed layers of all simulated passes.
    copy_end, stage_end, dma_of_stage = [], [], []  # per j; dma ends of staged copies, in order
    pre: list[float] = []  # per j: when its pre-hook ran (issues the copy slots - 1 ahead)
    spans: list[tuple[int, Span]] = []  # (pass, span)
    t, pass_start = 0.0, 0.0
    for p in range(_PASSES):
        pass_start = t
        spans.append((p, Span(Lane.COMPUTE, SpanKind.REST, "", t, t + rest)))
        t += rest
        for layer, seconds in zip(resident, profile.compute_s_per_layer[:r]):
            spans.append((p, Span(Lane.COMPUTE, SpanKind.COMPUTE, layer.key, t, t + seconds)))
            t += seconds
        for i, (layer, seconds) in enumerate(zip(streamed, profile.compute_s_per_layer[r:])):
            j = p * n + i
            pre.append(t)
            # Copies of j' <= j + slots - 1 are issued by now: simulate any not yet placed.
            while len(copy_end) < min(j + slots, _PASSES * n):
                k = len(copy_end)
                issue = 0.0 if k < slots else pre[k - slots + 1]
                _copy(k, streamed[k % n], tiers[streamed[k % n].key], issue, link, copy_end, stage_end,
                      dma_of_stage, spans, k // n)
            begin = max(t, copy_end[j])
            spans.append((p, Span(Lane.COMPUTE, SpanKind.COMPUTE, layer.key, begin, begin + seconds)))
            t = begin + seconds
    # The last pass, from its first compute; its first copies were issued in the pass before (< 0).
    shown = tuple(Span(s.lane, s.kind, s.layer, s.start_s - pass_start, s.end_s - pass_start, s.tier)
                  for p, s in spans if p == _PASSES - 1)
    return Timeline(plan.name, TimelineSource.PREDICTED, shown, t - pass_start)


def _copy(k: int, layer, tier: HostingTier, issue: float, link: LinkFacts, copy_end: list, stage_end: list,
          dma_of_stage: list, spans: list, pass_: int) -> None:
    """Place the copy of global streamed index ``k`` (its staging memcpy first, if staged)."""
    dma_from = max(issue, copy_end[-1] if copy_end else 0.0)
    if tier in STAGED_TIERS:
        buffer_free = dma_of_stage[-STAGING_BUFFERS] if len(dma_of_stage) >= STAGING_BUFFERS else 0.0
        s0 = max(issue, stage_end[-1] if stage_end else 0.0, buffer_free)
        s1 = s0 + layer.nbytes / link.pageable_Bps
        stage_end.append(s1)
        spans.append((pass_, Span(Lane.STAGING, SpanKind.STAGE, layer.key, s0, s1, tier)))
        dma_from = max(dma_from, s1)
    d1 = dma_from + layer.nbytes / link.pinned_Bps
    if tier in STAGED_TIERS:
        dma_of_stage.append(d1)
    copy_end.append(d1)
    spans.append((pass_, Span(Lane.COPY, SpanKind.COPY, layer.key, dma_from, d1, tier)))


def _unstreamed(profile: ComponentProfile, plan: ComponentPlan, link: LinkFacts) -> Timeline:
    """RESIDENT: compute only. MODEL_OFFLOAD: the whole component copied in (pageable), then compute."""
    spans, t = [], 0.0
    if plan.strategy is Strategy.MODEL_OFFLOAD:
        nbytes = profile.non_layer_bytes + sum(layer.tensor_bytes for layer in profile.layers)
        t = nbytes / link.pageable_Bps / max(plan.uses_per_request, 1)  # one copy per request, shown per pass
        spans.append(Span(Lane.COPY, SpanKind.COPY, "", 0.0, t, HostingTier.PAGEABLE))
    spans.append(Span(Lane.COMPUTE, SpanKind.REST, "", t, t + profile.compute_s_rest))
    t += profile.compute_s_rest
    for layer, seconds in zip(profile.layers, profile.compute_s_per_layer):
        spans.append(Span(Lane.COMPUTE, SpanKind.COMPUTE, layer.key, t, t + seconds))
        t += seconds
    return Timeline(plan.name, TimelineSource.PREDICTED, tuple(spans), t)


def measured_timeline(component: str, layer_s: Sequence[tuple[str, float]], wait_s: Sequence[tuple[str, float]],
                      rest_s: float) -> Timeline:
    """A warm-up's pass: non-layer compute, then per layer (in the order it ran) its wait, its compute."""
    waits = dict(wait_s)
    spans, t = [Span(Lane.COMPUTE, SpanKind.REST, "", 0.0, rest_s)], rest_s
    for key, seconds in layer_s:
        wait = waits.get(key, 0.0)
        if wait > 0:
            spans.append(Span(Lane.COMPUTE, SpanKind.WAIT, key, t, t + wait))
            t += wait
        spans.append(Span(Lane.COMPUTE, SpanKind.COMPUTE, key, t, t + seconds))
        t += seconds
    return Timeline(component, TimelineSource.MEASURED, tuple(spans), t)


def recorded_timeline(component: str, recorded: RecordedPass) -> Timeline:
    """A warm-up's recorded pass: compute, hook and non-layer spans on the compute stream, copies on the copy stream."""
    spans = [Span(Lane.COMPUTE, SpanKind.REST, "", a, b) for a, b in recorded.rest]
    spans += [Span(Lane.COMPUTE, SpanKind.WAIT, key, a, b) for key, a, b in recorded.waits]
    spans += [Span(Lane.COMPUTE, SpanKind.COMPUTE, key, a, b) for key, a, b in recorded.compute]
    spans += [Span(Lane.COPY, SpanKind.COPY, key, a, b) for key, a, b in recorded.copies]
    return Timeline(component, TimelineSource.MEASURED, tuple(sorted(spans, key=lambda s: (s.lane.value, s.start_s))),
                    recorded.pass_s)
