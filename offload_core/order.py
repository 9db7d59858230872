"""Which layers stream, and the order they run in: known before any plan is made.

The engine's ring prefetches "the next layers", LEADING keeps "the first layers" and STRIDED
spaces resident layers "evenly": all three are positions in *execution* order. The order in which
layer groups are declared is not always it: HunyuanVideo's token refiner sits in
``context_embedder`` and runs before every transformer block, whatever order a user lists the
groups in. Were the ring to follow the declaration, every step would stream the refiner's
copies into the wrong window (wasted) and LEADING would keep layers that run last.

So the order is settled once, here, and the planner (on ``meta`` models) and the engine (on real
ones) both take it from :func:`execution_order`:

- a *trace*: one forward the caller writes (``trace(model)``, with inputs on the ``meta``
  device) run with every parameter and buffer swapped for a ``meta`` tensor, so it computes
  nothing and allocates nothing; hooks record the order in which layers are first entered;
- or an explicit *layer order* (layer keys), validated against the layers found;
- else the declared order of the groups (the known classes' declarations are in execution
  order; tests trace each of them to prove it).

A layer with no parameters (an activation or a pooling step kept in a ``ModuleList``) has
nothing to copy: it gets no slot, no position in the ring and no hook.
"""
from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import torch
from torch import nn

from compat.torch import own_buffers, own_parameters
from offload_core.layout import LayoutError, resolve_layer_group

logger = logging.getLogger(__name__)

# Runs one forward of the model it is given; its inputs must be on the meta device.
Trace = Callable[[nn.Module], object]


@dataclass(frozen=True)
class OrderedLayer:
    """One streamable layer: its key, the group it belongs to, and the module itself."""

    key: str  # "blocks.3"
    group: str  # "blocks"
    module: nn.Module


def declared_layers(model: nn.Module, groups: Sequence[str]) -> tuple[OrderedLayer, ...]:
    """Every layer with parameters of every group, in the order the groups are declared."""
    found = []
    for path in groups:
        for i, module in enumerate(resolve_layer_group(model, path).layers):
            if any(True for _ in module.parameters()):
                found.append(OrderedLayer(f"{path}.{i}", path, module))
    return tuple(found)


def execution_order(model: nn.Module, groups: Sequence[str], *, trace: Trace | None = None,
                    layer_order: Sequence[str] | None = None) -> tuple[OrderedLayer, ...]:
    """The streamable layers of ``groups`` in the order they run (see the module docstring)."""
    layers = declared_layers(model, groups)
    if trace is not None and layer_order is not None:
        raise ValueError("give either a trace or a layer order, not both: they could disagree")
    if trace is not None:
        layer_order = traced_order(model, layers, trace)
    if layer_order is None:
        return layers
    ordered = _reorder(layers, tuple(layer_order))
    if ordered != layers:
        logger.info("layer order of %s: %s run first, not the declared %s (%d layers)",
                    type(model).__name__, _group_runs(ordered), _group_runs(layers), len(ordered))
    return ordered


def _reorder(layers: tuple[OrderedLayer, ...], keys: tuple[str, ...]) -> tuple[OrderedLayer, ...]:
    by_key = {layer.key: layer for layer in layers}
    unknown = [k for k in keys if k not in by_key]
    missing = [k for k in by_key if k not in keys]
    if unknown or missing or len(set(keys)) != len(keys):
        raise LayoutError(f"layer order must name every streamable layer once: unknown {unknown[:4]}, "
                          f"missing {missing[:4]}, {len(keys) - len(set(keys))} repeated")
    return tuple(by_key[k] for k in keys)


def _group_runs(layers: Sequence[OrderedLayer]) -> list[str]:
    """Groups in order of their layers, consecutive repeats collapsed ("blocks", "refiner", ...)."""
    runs: list[str] = []
    for layer in layers:
        if not runs or runs[-1] != layer.group:
            runs.append(layer.group)
    return runs


def traced_order(model: nn.Module, layers: Sequence[OrderedLayer], trace: Trace) -> tuple[str, ...]:
    """Layer keys in the order one forward of ``trace`` first enters them (on meta tensors)."""
    seen: dict[str, None] = {}
    handles = [layer.module.register_forward_pre_hook(lambda *_, key=layer.key: seen.setdefault(key))
               for layer in layers]
    try:
        with on_meta(model), torch.no_grad():
            trace(model)
    finally:
        for handle in handles:
            handle.remove()
    missing = [layer.key for layer in layers if layer.key not in seen]
    if missing:
        raise LayoutError(f"{type(model).__name__}: the traced forward never entered {len(missing)} streamed "
                          f"layers ({missing[:4]}): their place in the order is unknown; trace a forward that "
                          "runs every layer, or give layer_groups without them")
    return tuple(seen)


@contextlib.contextmanager
def on_meta(model: nn.Module) -> Iterator[None]:
    """Every parameter and buffer of ``model`` replaced by a ``meta`` twin for the body, then put back.

    The objects are swapped in the modules' registries (``.data`` cannot change device), ties kept:
    one meta twin per original tensor. The originals are restored even if the body raises.
    """
    twins: dict[int, torch.Tensor] = {}
    swapped: list[tuple[dict, str, torch.Tensor]] = []

    def twin(tensor: torch.Tensor) -> torch.Tensor:
        if id(tensor) not in twins:
            meta = torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype, device="meta")
            twins[id(tensor)] = nn.Parameter(meta, tensor.requires_grad) if isinstance(tensor, nn.Parameter) else meta
        return twins[id(tensor)]

    try:
        for module in model.modules():
            for registry in (own_parameters(module), own_buffers(module)):
                for name, tensor in registry.items():
                    if tensor is not None and tensor.device.type != "meta":
                        swapped.append((registry, name, tensor))
                        registry[name] = twin(tensor)
        yield
    finally:
        for registry, name, tensor in swapped:
            registry[name] = tensor


__all__ = ["OrderedLayer", "Trace", "declared_layers", "execution_order", "on_meta", "traced_order"]
