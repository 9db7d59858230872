"""A picture of a plan: per component, its weights as a strip coloured by where they live, and one
pass over its layers on the copy and compute streams, predicted and (for a running replica) measured.

:func:`plan_picture` turns a plan (and a replica's warm-up figures) into a :class:`PlanPicture`, a
frozen value that travels between processes (a stage replica makes it, the ingress renders it);
:func:`render` draws it with matplotlib (imported there only: planning never pays for it) as SVG or
PNG. The CLI (``offload-serve plan --picture plan.svg``) and ``GET /v1/residency/picture`` run both.

Colours are keyed on :class:`Placement` and hatches on the engine's ``WeightFormat`` (FP8 layers
are hatched over their tier's colour): a new placement or format is one entry in the tables below.
"""
from __future__ import annotations

import enum
import io
from dataclasses import dataclass
from typing import Mapping

from offload_core.host.tier import HostingTier
from offload_core.planner.measured_compute import MeasuredCompute
from offload_core.planner.pipeline_plan import ComponentPlan, PipelinePlan
from offload_core.planner.strategy import Strategy
from offload_core.planner.timeline import (
    Lane,
    SpanKind,
    Timeline,
    measured_timeline,
    predicted_timeline,
    recorded_timeline,
)
from offload_core.quant import WeightFormat  # the engine's: NATIVE or FP8 (hosted and copied 8-bit)


class Placement(enum.Enum):
    """Where a stretch of a component's weights lives between its uses."""

    DEVICE = "on the device"  # resident layers, kept non-layer weights
    PINNED = "pinned host"
    PAGEABLE = "pageable host"
    MAPPED = "file mapping"
    PARKED = "parked between uses"  # non-layer weights the gate moves off the device between uses
    HOST_TABLE = "token table on the host"  # gathered on the host, never copied whole
    OFFLOADED = "model offload"  # the whole component copied in for its stage


_BY_TIER = {HostingTier.PINNED: Placement.PINNED, HostingTier.PAGEABLE: Placement.PAGEABLE,
            HostingTier.MAPPED: Placement.MAPPED}
# Colour-blind-safe (Okabe-Ito); one per placement.
COLOURS = {Placement.DEVICE: "#009E73", Placement.PINNED: "#0072B2", Placement.PAGEABLE: "#56B4E9",
           Placement.MAPPED: "#999999", Placement.PARKED: "#E69F00", Placement.HOST_TABLE: "#CC79A7",
           Placement.OFFLOADED: "#D55E00"}
HATCHES = {WeightFormat.NATIVE: "", WeightFormat.FP8: "xx"}
# Spans in Paul Tol's muted scheme, apart from the placements' colours.
_SPAN_COLOURS = {SpanKind.COMPUTE: "#117733", SpanKind.REST: "#999933", SpanKind.WAIT: "#CC6677",
                 SpanKind.STAGE: "#88CCEE", SpanKind.COPY: "#332288"}


@dataclass(frozen=True)
class Segment:
    """A stretch of the strip: one layer, or the component's non-layer weights (``key`` "")."""

    key: str
    placement: Placement
    nbytes: int
    format: WeightFormat = WeightFormat.NATIVE


@dataclass(frozen=True)
class ComponentPicture:
    name: str
    summary: str  # strategy, resident layers, depth
    segments: tuple[Segment, ...]  # non-layer weights first, then the layers in the order they run
    predicted: Timeline
    measured: Timeline | None = None


@dataclass(frozen=True)
class PlanPicture:
    title: str
    components: tuple[ComponentPicture, ...]


def plan_picture(plan: PipelinePlan, measured: Mapping[str, MeasuredCompute] | None = None,
                 formats: Mapping[str, Mapping[str, WeightFormat]] | None = None,
                 title: str | None = None) -> PlanPicture:
    """What :func:`render` draws for ``plan``; ``measured`` per component from a warm-up, ``formats``
    per component and layer key (absent: native). The plan must carry its facts (``plan_pipeline`` does)."""
    if plan.facts is None:
        raise ValueError("the plan carries no facts to draw from: make it with plan_pipeline")
    pictures = []
    for c in plan.components:
        profile = plan.facts.component(c.name)
        m = (measured or {}).get(c.name)
        pictures.append(ComponentPicture(
            c.name, _summary(c), _segments(c, profile, (formats or {}).get(c.name, {})),
            predicted_timeline(profile, c, plan.facts.link),
            _measured(c.name, m)))
    return PlanPicture(title or plan.explain()[0].split(":")[0], tuple(pictures))


def _measured(name: str, m: MeasuredCompute | None) -> Timeline | None:
    """The warm-up's recorded pass (copies included) where it kept one, else its per-use means."""
    if m is None:
        return None
    if m.last_pass is not None:
        return recorded_timeline(name, m.last_pass)
    return measured_timeline(name, m.layer_s, m.layer_wait_s, m.rest_s)


def _summary(c: ComponentPlan) -> str:
    if c.strategy is not Strategy.LAYERWISE:
        return c.strategy.value + ("; tables on host" if c.host_tables else "")
    park = "; parked between uses" if (c.prediction.parked if c.prediction else c.park) else ""
    return f"layerwise: {c.resident_layers}/{len(c.hosting)} resident, depth {c.prefetch_depth}{park}"


def _segments(c: ComponentPlan, profile, formats: Mapping[str, WeightFormat]) -> tuple[Segment, ...]:
    tables = profile.table_bytes if c.host_tables else 0
    rest = profile.non_layer_bytes - tables
    if c.strategy is Strategy.MODEL_OFFLOAD:
        kept = Placement.OFFLOADED
    elif c.strategy is Strategy.LAYERWISE and (c.prediction.parked if c.prediction else c.park):
        kept = Placement.PARKED
    else:
        kept = Placement.DEVICE
    out = [Segment("", kept, rest)] if rest else []
    if tables:
        out.append(Segment("", Placement.HOST_TABLE, tables))
    tiers = dict(c.hosting)
    for i, layer in enumerate(profile.layers):
        if c.strategy is Strategy.LAYERWISE:
            where = Placement.DEVICE if i < c.resident_layers else _BY_TIER[tiers[layer.key]]
        else:
            where = kept
        out.append(Segment(layer.key, where, layer.nbytes, formats.get(layer.key, WeightFormat.NATIVE)))
    return tuple(out)


def render(picture: PlanPicture, fmt: str = "svg") -> bytes:
    """The picture as SVG or PNG bytes (matplotlib, no display needed; SVG without a date, so the
    same plan draws the same file)."""
    if fmt not in ("svg", "png"):
        raise ValueError(f"a plan picture is svg or png, not {fmt!r}")
    import matplotlib
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    rows = len(picture.components)
    figure = Figure(figsize=(11, 1.0 + 2.4 * rows), layout="constrained")
    grid = figure.add_gridspec(2 * rows, 2, height_ratios=[0.45, 1.4] * rows)
    for i, comp in enumerate(picture.components):
        _strip(figure.add_subplot(grid[2 * i, :]), comp)
        if comp.measured is None:  # the CLI: no replica ran it, the prediction takes the width
            _lanes(figure.add_subplot(grid[2 * i + 1, :]), comp.predicted)
            continue
        # Side by side on one time axis, so a measured pass longer than predicted looks longer.
        left = figure.add_subplot(grid[2 * i + 1, 0])
        _lanes(left, comp.predicted)
        _lanes(figure.add_subplot(grid[2 * i + 1, 1], sharex=left), comp.measured)
    used = {s.placement for c in picture.components for s in c.segments}
    handles = [Patch(facecolor=COLOURS[p], label=p.value) for p in Placement if p in used]
    handles += [Patch(facecolor="white", edgecolor="black", hatch=HATCHES[f], label=f"{f.value} weights")
                for f in WeightFormat if f is not WeightFormat.NATIVE
                and any(s.format is f for c in picture.components for s in c.segments)]
    kinds = {s.kind for c in picture.components for t in (c.predicted, c.measured) if t for s in t.spans}
    handles += [Patch(facecolor=_SPAN_COLOURS[k], label=k.value) for k in SpanKind if k in kinds]
    figure.legend(handles=handles, loc="outside lower center", ncols=6, fontsize=7, frameon=False)
    figure.suptitle(picture.title, fontsize=10)
    out = io.BytesIO()
    with matplotlib.rc_context({"svg.hashsalt": "offload-serve", "svg.fonttype": "none"}):
        figure.savefig(out, format=fmt, metadata={"Date": None} if fmt == "svg" else None, dpi=110)
    return out.getvalue()


def _strip(ax, comp: ComponentPicture) -> None:
    """The weights left to right, widths by bytes, coloured by placement."""
    total = sum(s.nbytes for s in comp.segments) or 1
    x = 0.0
    for s in comp.segments:
        width = s.nbytes / total
        ax.barh(0, width, left=x, height=1.0, color=COLOURS[s.placement], hatch=HATCHES[s.format],
                edgecolor="white", linewidth=0.3)
        x += width
    ax.set_xlim(0, 1)
    ax.set_ylim(-0.5, 0.5)
    ax.set_yticks([])
    ax.set_xticks([])
    layers = sum(1 for s in comp.segments if s.key)
    ax.set_title(f"{comp.name}: {comp.summary}; {total / 2**30:.2f} GiB of weights, {layers} layers "
                 "(widths by bytes, non-layer weights first)", fontsize=8, loc="left")


def _lanes(ax, timeline: Timeline) -> None:
    lanes = [lane for lane in Lane if timeline.lane(lane)]
    for row, lane in enumerate(lanes):
        for s in timeline.lane(lane):
            ax.barh(row, (s.end_s - s.start_s) * 1e3, left=s.start_s * 1e3, height=0.7,
                    color=_SPAN_COLOURS[s.kind], edgecolor="white", linewidth=0.2)
    ax.set_yticks(range(len(lanes)), [lane.value for lane in lanes], fontsize=7)
    ax.invert_yaxis()
    ax.tick_params(axis="x", labelsize=7)
    ax.set_xlabel("ms from the pass's first compute (a copy issued in the pass before starts < 0)", fontsize=7)
    wait = sum(s.end_s - s.start_s for s in timeline.spans if s.kind is SpanKind.WAIT)
    copies = timeline.busy_s(Lane.COPY)
    parts = [f"one pass {_seconds(timeline.pass_s)}", f"compute {_seconds(timeline.busy_s(Lane.COMPUTE) - wait)}"]
    parts += [f"copies {_seconds(copies)}"] if copies else []
    parts += [f"waiting for copies {_seconds(wait)}"] if wait else []
    ax.set_title(f"{timeline.component}, {timeline.source.value}: " + ", ".join(parts), fontsize=8, loc="left")


def _seconds(value: float) -> str:
    return f"{value:.2f} s" if value >= 1 else f"{value * 1e3:.1f} ms"
