"""Taking a model's layers off the device: found in execution order, checked, hosted, released.

Before any hook exists, :func:`offload_core.streaming.engine.apply_layer_streaming` finds the
layers of the declared groups (:func:`collect_layers`), checks each layer's hosting tier
(:func:`layer_tiers`), and consolidates every layer on the host, releasing its parameters to
placeholders as it goes (:func:`move_layers_off`). Runs once per model, in the process that will
stream it (a stage replica at load, or a user's process).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import torch
from torch import nn

from offload_core.host.tier import HostingTier
from offload_core.layout import LayerLayout, LayoutError, layer_parameters, placeholder, plan_layer_layout
from offload_core.order import OrderedLayer
from offload_core.progress import ByteProgress
from offload_core.quant import WeightFormat, quantized_names
from offload_core.streaming.device import Device
from offload_core.streaming.host_layer import HostLayer


@dataclass(frozen=True)
class LayerEntry:
    """One layer found in a group, before it is moved: where it is and how it will be laid out."""

    group: int  # index of its group in the declared groups (moved off largest group first)
    key: str  # "single_transformer_blocks.2"
    module: nn.Module
    params: tuple[nn.Parameter, ...]  # in layout.tensors order
    layout: LayerLayout


def collect_layers(paths: tuple[str, ...], ordered: tuple[OrderedLayer, ...],
                    weights: WeightFormat) -> tuple[LayerEntry, ...]:
    """Every layer with parameters, in execution order (layers without any get no slot)."""
    entries = []
    for layer in ordered:
        named = layer_parameters(layer.module)
        layout = plan_layer_layout(layer.key, [(n, p.data) for n, p in named], quantized_names(layer.module, weights))
        entries.append(LayerEntry(paths.index(layer.group), layer.key, layer.module, tuple(p for _, p in named),
                                   layout))
    return tuple(entries)


def layer_tiers(entries: tuple[LayerEntry, ...], hosting: Mapping[str, HostingTier]) -> dict[str, HostingTier]:
    """Each layer's hosting tier (PAGEABLE unless named), checked before anything moves."""
    keys = [e.key for e in entries]
    unknown = sorted(set(hosting) - set(keys))
    if unknown:
        raise ValueError(f"hosting names layers that are not streamed: {unknown} (layers: {keys[:6]}...)")
    tiers = {key: hosting.get(key, HostingTier.PAGEABLE) for key in keys}
    for entry in entries:
        off_host = [name for name, p in zip((m.name for m in entry.layout.tensors), entry.params)
                    if p.device.type != "cpu"]
        if tiers[entry.key] is HostingTier.MAPPED and off_host:
            raise LayoutError(f"layer {entry.key} is planned MAPPED, which keeps host tensors as they are, "
                              f"but {off_host[0]} is on {entry.params[0].device}")
    return tiers


def move_layers_off(entries: tuple[LayerEntry, ...], tiers: Mapping[str, HostingTier],
                     context: Device, prebuilt: Mapping[str, HostLayer]) -> dict[str, HostLayer]:
    """Consolidate every layer on the host and release it, the largest group first.

    Largest first: when the model starts on the device, freeing the biggest group first leaves
    the most room for everything after it; each layer is released as soon as it is copied, so
    the host holds at most one layer twice. If a layer cannot be moved (a refused pin), the
    layers already moved get their weights back where they were and the error propagates.
    """
    group_bytes: dict[int, int] = {}
    for entry in entries:
        group_bytes[entry.group] = group_bytes.get(entry.group, 0) + entry.layout.nbytes
    order = sorted(entries, key=lambda e: -group_bytes[e.group])  # stable: layers keep their order
    moved: list[tuple[LayerEntry, HostLayer, list[torch.device]]] = []
    tiers_used = sorted({tiers[e.key].value for e in entries if e.key not in prebuilt})
    try:
        # Tens of GB for a 14B model (pinning included): logged with its rate, a bar in a terminal.
        with ByteProgress(f"hosting layers ({', '.join(tiers_used) or 'shared copies'})",
                          sum(e.layout.host_nbytes for e in entries if e.key not in prebuilt)) as progress:
            for entry in order:
                host = prebuilt.get(entry.key)
                if host is not None and host.layout != entry.layout:
                    raise LayoutError(f"layer {entry.key}: the given host copy is laid out differently from the layer")
                if host is None:
                    host = HostLayer.consolidate(entry.layout, [p.data for p in entry.params], tiers[entry.key],
                                                 context.device)
                    progress.update(entry.layout.host_nbytes)
                moved.append((entry, host, [p.device for p in entry.params]))
                for param in entry.params:
                    param.data = placeholder(context.device, param.dtype)
    except Exception:
        for entry, host, devices in moved:
            for param, view, where in zip(entry.params, host.host_views(), devices):
                param.data = view.to(where)
            host.free()
        raise
    hosts = {entry.key: host for entry, host, _ in moved}
    return hosts
