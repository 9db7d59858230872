"""Facts measured on a warm-up request: uses per request and compute time per layer, as the planner takes them.

A pipeline's components are called a model-dependent number of times per request (Wan runs the
text encoder for the prompt and the negative prompt, the denoiser twice per step for guidance,
the VAE decoder once per latent frame), so counting beats guessing. The figures are measured by
:func:`offload_core.residency.compute_meter.measure_warmup` (hooks on a running model: runtime
state, which the planner never holds); here they become plain facts: :class:`WarmupFigures` per
component, :class:`MeasuredCompute` per use, and profiles carrying them.

Run by each stage replica (its warm-up and first uses) and by whichever process plans.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Mapping, Sequence

from torch import nn

from offload_core.planner.facts import (
    ComponentProfile,
    profile_component,
)
from offload_core.tables import HostTablesConfig


@dataclass(frozen=True)
class RecordedPass:
    """A component's last pass over its layers in the warm-up, as it ran: seconds from its start (the
    component's forward, else its first layer's hooks). Spans are (layer key, start, end)."""

    compute: tuple[tuple[str, float, float], ...]  # each layer's compute, in the order they ran
    waits: tuple[tuple[str, float, float], ...]  # in a layer's hooks outside its compute (copy waits, issues)
    rest: tuple[tuple[float, float], ...]  # the component's forward outside its layers (non-layer compute)
    # The copy that fed each streamed layer of the pass, on the copy stream (it may start in the pass
    # before: < 0); resident layers and unstreamed components have none.
    copies: tuple[tuple[str, float, float], ...]
    pass_s: float


@dataclass(frozen=True)
class WarmupFigures:
    """One component's measured figures for one request."""

    uses: int  # passes over its first layer (or calls of the module, without layer groups)
    order: tuple[str, ...]  # layer keys in the order they first ran
    layer_s: tuple[float, ...]  # mean seconds of compute per use, per layer, in that order
    total_s: float  # seconds inside the component's own forwards, per request (copy waits included)
    # Seconds per request spent in the layers with every hook on them (their compute, the streamer's
    # hooks and waits); total_s minus this is the component's non-layer compute.
    layer_span_s: float = 0.0
    # Per layer, in ``order``, seconds per use in its hooks outside its compute: a streamed layer's
    # wait for its copy (and the streamer's hook work). What the picture's measured pass shows.
    layer_wait_s: tuple[float, ...] = ()
    last_pass: RecordedPass | None = None  # None: no layer groups (the hooks sit on its children)
    # Layer keys the call never ran, in declared order (all of them: the component did not run).
    unrun: tuple[str, ...] = ()

    @property
    def ran(self) -> bool:
        """The call ran the component (some of its layers, or its forward when it has no layer groups)."""
        return bool(self.order) or (not self.unrun and self.uses > 0)

    @property
    def rest_s(self) -> float:
        """Non-layer compute per use (embeddings, norms, heads): no layer, no copy wait in it."""
        return max(self.total_s - self.layer_span_s, 0.0) / max(self.uses, 1)


@dataclass(frozen=True)
class MeasuredCompute:
    """One component's compute per use, as measured: seconds per layer by key, and the rest."""

    layer_s: tuple[tuple[str, float], ...]  # (layer key, seconds per use)
    rest_s: float  # non-layer seconds per use
    layer_wait_s: tuple[tuple[str, float], ...] = ()  # (layer key, seconds per use outside compute)
    last_pass: RecordedPass | None = None  # one real pass, copies included: the picture's measured timeline
    # Layer keys the measured call never ran: their seconds in ``layer_s`` are estimated
    # (:func:`with_estimates`) until a call that runs them measures them.
    estimated: tuple[str, ...] = ()

    @property
    def per_use_s(self) -> float:
        return sum(s for _, s in self.layer_s) + self.rest_s

    @classmethod
    def of(cls, figures: WarmupFigures) -> MeasuredCompute:
        return cls(tuple(zip(figures.order, figures.layer_s)), figures.rest_s,
                   tuple(zip(figures.order, figures.layer_wait_s)), figures.last_pass, figures.unrun)

    def scaled(self, factor: float) -> MeasuredCompute:
        """Every figure times ``factor`` (per use as another count of uses sees it); the recorded pass
        is one pass as it ran, kept as is."""
        return MeasuredCompute(tuple((k, s * factor) for k, s in self.layer_s), self.rest_s * factor,
                               tuple((k, s * factor) for k, s in self.layer_wait_s), self.last_pass, self.estimated)


def seconds_per_parameter(profiles: Sequence[ComponentProfile], compute: Mapping[str, MeasuredCompute]) -> float:
    """Measured seconds per use per layer parameter over every layer a call ran (0.0: none ran)."""
    params = {(p.name, layer.key): layer.params for p in profiles for layer in p.layers}
    seconds = count = 0
    for name, measured in compute.items():
        for key, s in measured.layer_s:
            if key not in measured.estimated and (name, key) in params:
                seconds, count = seconds + s, count + params[(name, key)]
    return seconds / count if count else 0.0


def with_estimates(profile: ComponentProfile, measured: MeasuredCompute, stage_rate_s: float) -> MeasuredCompute:
    """``measured`` with a figure for every layer of ``profile`` it lacks (``measured.estimated``): the
    cost model's compute in proportion to parameters (2 FLOPs per parameter per token), at the seconds
    per parameter this component's measured layers took, else the stage's (``stage_rate_s``).

    Non-layer compute of a component that never ran stays 0 s (embeddings and norms: lookups and
    element-wise work). Underestimated compute plans more resident layers, never a stall.
    """
    if not measured.estimated:
        return measured
    own = seconds_per_parameter((profile,), {profile.name: measured})
    rate = own or stage_rate_s
    by_key = dict(measured.layer_s)
    layer_s = tuple((layer.key, by_key[layer.key] if layer.key in by_key and layer.key not in measured.estimated
                     else rate * layer.params) for layer in profile.layers)
    return dataclasses.replace(measured, layer_s=layer_s)


def with_measured_compute(profile: ComponentProfile, measured: MeasuredCompute) -> ComponentProfile:
    """``profile`` (layers in its own order) with the measured seconds per use of each of its layers."""
    by_key = dict(measured.layer_s)
    missing = [layer.key for layer in profile.layers if layer.key not in by_key]
    if missing:
        raise ValueError(f"{profile.name}: no measured compute for layers {missing[:4]}")
    return dataclasses.replace(profile, compute_s_per_layer=tuple(by_key[layer.key] for layer in profile.layers),
                               compute_s_rest=measured.rest_s)


def profiles_from_warmup(components: Mapping[str, nn.Module], figures: Mapping[str, WarmupFigures],
                         tables: HostTablesConfig = HostTablesConfig(),
                         layer_groups: Mapping[str, Sequence[str]] | None = None) -> tuple[ComponentProfile, ...]:
    """Component profiles with the measured uses and per-layer compute times."""
    profiles = []
    for name, model in components.items():
        f = figures[name]
        profiles.append(profile_component(name, model, uses_per_request=f.uses, compute_s_per_layer=f.layer_s,
                                          compute_s_rest=f.rest_s, tables=tables, layer_order=f.order,
                                          layer_groups=(layer_groups or {}).get(name)))
    return tuple(profiles)
