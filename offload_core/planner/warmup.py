"""Facts measured on a warm-up request: uses per request and compute time per layer.

A pipeline's components are called a model-dependent number of times per request (Wan runs the
text encoder for the prompt and the negative prompt, the denoiser twice per step for guidance,
the VAE decoder once per latent frame), so counting beats guessing. Hooks on each component's
layers count passes over the first layer and time each layer; the warm-up runs the plain model.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

import torch
from torch import nn

from offload_core.layout import resolve_layer_group
from offload_core.planner.facts import (
    ComponentProfile,
    profile_component,
    streamable_groups,
)
from offload_core.tables import HostTablesConfig


@dataclass(frozen=True)
class WarmupFigures:
    """One component's measured figures for one request."""

    uses: int  # passes over its first layer (or calls of the module, without layer groups)
    layer_s: tuple[float, ...]  # mean seconds per use, per layer, in execution order
    total_s: float  # seconds inside the component's own forwards, per request


class _Timer:
    def __init__(self, sync: Callable[[], None]):
        self.sync, self.elapsed, self.calls, self._start = sync, 0.0, 0, 0.0

    def pre(self, *_):
        self.sync()
        self._start = time.perf_counter()

    def post(self, *_):
        self.sync()
        self.elapsed += time.perf_counter() - self._start
        self.calls += 1


def measure_warmup(components: Mapping[str, nn.Module], run: Callable[[], object],
                   layer_groups: Mapping[str, Sequence[str]] | None = None) -> dict[str, WarmupFigures]:
    """Run ``run`` once with timing hooks on every component; returns per-component figures."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    handles, timers = [], {}
    for name, model in components.items():
        groups = streamable_groups(model, (layer_groups or {}).get(name))
        layers = [layer for path in groups for layer in resolve_layer_group(model, path).layers]
        timers[name] = ([_Timer(sync) for _ in layers], _Timer(sync))
        for layer, timer in zip(layers, timers[name][0]):
            handles += [layer.register_forward_pre_hook(timer.pre), layer.register_forward_hook(timer.post)]
        # Components whose pipeline calls a method (vae.decode) rather than forward: time every child.
        roots = [model] if layers else list(model.children()) or [model]
        for root in roots:
            handles += [root.register_forward_pre_hook(timers[name][1].pre),
                        root.register_forward_hook(timers[name][1].post)]
    try:
        with torch.no_grad():
            run()
    finally:
        for handle in handles:
            handle.remove()
    out = {}
    for name, (layer_timers, root) in timers.items():
        uses = layer_timers[0].calls if layer_timers else root.calls
        per_layer = tuple(t.elapsed / max(uses, 1) for t in layer_timers)
        out[name] = WarmupFigures(uses, per_layer, root.elapsed)
    return out


def profiles_from_warmup(components: Mapping[str, nn.Module], figures: Mapping[str, WarmupFigures],
                         tables: HostTablesConfig = HostTablesConfig(),
                         layer_groups: Mapping[str, Sequence[str]] | None = None) -> tuple[ComponentProfile, ...]:
    """Component profiles with the measured uses and per-layer compute times."""
    profiles = []
    for name, model in components.items():
        f = figures[name]
        rest = max(f.total_s - sum(f.layer_s) * f.uses, 0.0) / max(f.uses, 1)
        profiles.append(profile_component(name, model, uses_per_request=f.uses, compute_s_per_layer=f.layer_s,
                                          compute_s_rest=rest, tables=tables,
                                          layer_groups=(layer_groups or {}).get(name)))
    return tuple(profiles)
