"""Facts measured on a warm-up request: uses per request and compute time per layer.

A pipeline's components are called a model-dependent number of times per request (Wan runs the
text encoder for the prompt and the negative prompt, the denoiser twice per step for guidance,
the VAE decoder once per latent frame), so counting beats guessing. Hooks on each component's
layers count passes over the first layer that runs, time each layer, and note the order layers
first run in (the profile's execution order); the warm-up runs the plain model.
"""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

import torch
from torch import nn

from offload_core.order import declared_layers
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
    order: tuple[str, ...]  # layer keys in the order they first ran
    layer_s: tuple[float, ...]  # mean seconds per use, per layer, in that order
    total_s: float  # seconds inside the component's own forwards, per request


_ENTRIES = itertools.count(1)  # a global clock of first entries: orders layers across groups


class _Timer:
    def __init__(self, sync: Callable[[], None]):
        self.sync, self.elapsed, self.calls, self._start = sync, 0.0, 0, 0.0
        self.first = 0  # when the layer first ran, on the _ENTRIES clock (0: not yet)

    def pre(self, *_):
        self.sync()
        self._start = time.perf_counter()
        self.first = self.first or next(_ENTRIES)

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
        layers = declared_layers(model, streamable_groups(model, (layer_groups or {}).get(name)))
        timers[name] = ([(layer.key, _Timer(sync)) for layer in layers], _Timer(sync))
        for layer, (_, timer) in zip(layers, timers[name][0]):
            handles += [layer.module.register_forward_pre_hook(timer.pre),
                        layer.module.register_forward_hook(timer.post)]
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
        never = [key for key, t in layer_timers if not t.calls]
        if never:
            raise ValueError(f"{name}: the warm-up never ran layers {never[:4]}: their compute and order are unknown")
        ran = sorted(layer_timers, key=lambda item: item[1].first)
        uses = ran[0][1].calls if ran else root.calls
        per_layer = tuple(t.elapsed / max(uses, 1) for _, t in ran)
        out[name] = WarmupFigures(uses, tuple(key for key, _ in ran), per_layer, root.elapsed)
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
                                          compute_s_rest=rest, tables=tables, layer_order=f.order,
                                          layer_groups=(layer_groups or {}).get(name)))
    return tuple(profiles)
