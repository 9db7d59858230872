"""Compute per layer, measured on a warm-up request by hooks on the running model (the planner takes the figures).

A pipeline's components are called a model-dependent number of times per request (Wan runs the
text encoder for the prompt and the negative prompt, the denoiser twice per step for guidance,
the VAE decoder once per latent frame), so counting beats guessing. Hooks on each component's
layers count passes over the first layer that runs, time each layer, and note the order layers
first ran in (the profile's execution order). The warm-up may run the plain model or a model
already under streaming (a service replica times its layers as applied):

- a layer's *compute* is timed by an inner pair of hooks: the pre-hook registered after any hook
  already on the layer (the streamer's, which waits for the layer's copy and issues the next
  ones), the post-hook put before them (so the streamer's release is not counted either); on CUDA
  each syncs the *current* (compute) stream only, never the copy stream, so a copy still in flight
  for a later layer is not waited for;
- an outer pair spans the layer with every hook on it, so the component's non-layer compute
  (total minus the spans) holds no copy wait either. A streamed layer's wait for its copy is in
  neither figure: it is transfer, which the cost model adds from the link, not compute.

The last pass is also kept as it ran (:class:`RecordedPass`): each layer's compute and hook spans,
the non-layer compute between them and, for a streamed component, the copy that fed each layer on
the copy stream (``offload_core.streaming.copy_log``, attached to its streamer for the warm-up only).
The plan's picture draws it beside the predicted pass.
"""
from __future__ import annotations

import contextlib
import itertools
import time
from typing import Callable, Mapping, Sequence

import torch
from torch import nn

from offload_core.layout import STREAMER_ATTRIBUTE
from offload_core.order import declared_layers
from offload_core.planner.facts import streamable_groups
from offload_core.planner.measured_compute import RecordedPass, WarmupFigures
from offload_core.streaming.copy_log import CopyLog, CopySpan

_ENTRIES = itertools.count(1)  # a global clock of first entries: orders layers across groups


def compute_sync(device: torch.device | None = None) -> Callable[[], None]:
    """Wait for the kernels of the current stream only: never for copies on another stream."""
    if not torch.cuda.is_available() or (device is not None and torch.device(device).type != "cuda"):
        return lambda: None
    return lambda: torch.cuda.current_stream().synchronize()


class _Timer:
    def __init__(self, sync: Callable[[], None]):
        self.sync, self.elapsed, self.calls, self._start = sync, 0.0, 0, 0.0
        self.first = 0  # when the layer first ran, on the _ENTRIES clock (0: not yet)
        self.last: tuple[float, float] | None = None  # the last call's (start, end), perf_counter seconds
        self.previous: tuple[float, float] | None = None  # the call before it (None: ran once)

    def pre(self, *_):
        self.sync()
        self._start = time.perf_counter()
        self.first = self.first or next(_ENTRIES)

    def post(self, *_):
        self.sync()
        end = time.perf_counter()
        self.elapsed += end - self._start
        self.calls += 1
        self.previous, self.last = self.last, (self._start, end)


def _hook(module: nn.Module, inner: _Timer, outer: _Timer) -> list:
    """Inner timer closest to the forward (compute only), outer around every other hook (the span)."""
    return [module.register_forward_pre_hook(outer.pre, prepend=True),
            module.register_forward_pre_hook(inner.pre),
            module.register_forward_hook(inner.post, prepend=True),
            module.register_forward_hook(outer.post, always_call=True)]


def measure_warmup(components: Mapping[str, nn.Module], run: Callable[[], object],
                   layer_groups: Mapping[str, Sequence[str]] | None = None,
                   device: torch.device | None = None) -> dict[str, WarmupFigures]:
    """Run ``run`` once with timing hooks on every component; returns per-component figures.

    ``device``: where the components compute (None: CUDA's current stream is synced when CUDA is
    available, as for a plain model on the GPU).
    """
    with LayerTiming(components, layer_groups, device) as timers:
        with torch.no_grad():
            run()
    return timers.figures()


class LayerTiming(contextlib.AbstractContextManager):
    """Timing hooks on ``components`` while the block runs (a warm-up call, or a service call that
    runs a component for the first time); :meth:`figures` after the block."""

    def __init__(self, components: Mapping[str, nn.Module], layer_groups: Mapping[str, Sequence[str]] | None = None,
                 device: torch.device | None = None):
        self._components, self._groups, self._sync = components, layer_groups or {}, compute_sync(device)
        self._handles, self._timers, self._logs, self._figures = [], {}, {}, None

    def __enter__(self) -> "LayerTiming":
        sync = self._sync
        for name, model in self._components.items():
            streamer = getattr(model, STREAMER_ATTRIBUTE, None)
            if streamer is not None:  # its copies, for the measured pass's copy lane
                self._logs[name] = CopyLog(streamer.device.device)
                streamer.trace_copies(self._logs[name])
            layers = declared_layers(model, streamable_groups(model, self._groups.get(name)))
            pairs = [(layer.key, _Timer(sync), _Timer(sync)) for layer in layers]
            self._timers[name] = (pairs, _Timer(sync))
            for layer, (_, inner, outer) in zip(layers, pairs):
                self._handles += _hook(layer.module, inner, outer)
            # Components whose pipeline calls a method (vae.decode) rather than forward: time every child.
            roots = [model] if layers else list(model.children()) or [model]
            for root in roots:
                self._handles += [root.register_forward_pre_hook(self._timers[name][1].pre, prepend=True),
                                  root.register_forward_hook(self._timers[name][1].post, always_call=True)]
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        for name in self._logs:
            getattr(self._components[name], STREAMER_ATTRIBUTE).trace_copies(None)
        self._figures = {name: _figures(pairs, root, self._logs[name].spans() if name in self._logs else ())
                         for name, (pairs, root) in self._timers.items()}

    def figures(self) -> dict[str, WarmupFigures]:
        if self._figures is None:
            raise RuntimeError("LayerTiming: figures are known once the timed block has ended")
        return self._figures


def _figures(pairs: Sequence[tuple[str, _Timer, _Timer]], root: _Timer, copies: Sequence[CopySpan]) -> WarmupFigures:
    """One component's figures; layers the call never ran (a component or a group the request did not
    use: a glyph encoder without quoted text, an expert before its boundary step) are named in
    ``unrun``, in declared order, for the caller to estimate and measure on first use."""
    ran = sorted((item for item in pairs if item[1].calls), key=lambda item: item[1].first)
    unrun = tuple(key for key, t, _ in pairs if not t.calls)
    if pairs and not ran:  # the component did not run at all: nothing measured, not even its forward
        return WarmupFigures(0, (), (), 0.0, unrun=unrun)
    uses = ran[0][1].calls if ran else root.calls
    per_layer = tuple(t.elapsed / max(uses, 1) for _, t, _ in ran)
    waits = tuple(max(o.elapsed - t.elapsed, 0.0) / max(uses, 1) for _, t, o in ran)
    return WarmupFigures(uses, tuple(key for key, _, _ in ran), per_layer, root.elapsed,
                         sum(o.elapsed for _, _, o in ran), waits, _last_pass(ran, root, copies) if ran else None,
                         unrun)


def _last_pass(ran: Sequence[tuple[str, _Timer, _Timer]], root: _Timer, copies: Sequence[CopySpan]) -> RecordedPass:
    """The last pass over the layers as it ran: from the last entry of the first layer to run, the
    layers entered since (a layer a step cache skipped in it is not drawn), and the copy that fed each."""
    begin = ran[0][2].last[0]
    layers = sorted(((key, inner.last, outer.last) for key, inner, outer in ran if outer.last[0] >= begin),
                    key=lambda item: item[2][0])
    start, end = begin, max(outer[1] for _, _, outer in layers)
    if root.last is not None and root.last[0] <= start and root.last[1] >= end:
        start, end = root.last  # the component's forward around them: its non-layer compute too
    rest, cursor = [], start
    for _, _, (a, b) in layers + [("", (end, end), (end, end))]:
        if a > cursor:
            rest.append((cursor - start, a - start))
        cursor = max(cursor, b)
    waits = [(key, a - start, b - start) for key, inner, outer in layers
             for a, b in ((outer[0], inner[0]), (inner[1], outer[1])) if b > a]
    fed = []
    previous = {key: inner.previous for key, inner, _ in ran}
    for key, inner, _ in layers:
        # The latest copy of the layer issued before it computed and after its previous run ended (a
        # layer the ring kept from that run was not copied for this one). Not "within a pass's length":
        # the first layer's copy is issued when the use is prepared, which a loaded host can delay by
        # more than a tiny model's pass (CI dropped it so).
        since = previous[key][1] if previous[key] is not None else float("-inf")
        feeding = [c for c in copies if c.key == key and since <= c.start_s <= inner[0]]
        if feeding:
            fed.append((key, feeding[-1].start_s - start, feeding[-1].end_s - start))
    return RecordedPass(tuple((key, inner[0] - start, inner[1] - start) for key, inner, _ in layers), tuple(waits),
                        tuple(rest), tuple(fed), end - start)
