"""One stage replica's components under offload_core, and where their weights are.

:class:`StageResidency` is the only place the service touches the engine. Each component with
declared layer groups (``offload_core.layout.declared_layer_groups``) is streamed with
``offload_core.streaming.apply_layer_streaming`` using the stage's :class:`OffloadMode`; a component
without layer groups is placed whole on the device. Every decision is logged once per component
and shows in :meth:`StageResidency.placements`.
"""
from __future__ import annotations

import enum
import importlib
import logging
from dataclasses import dataclass
from typing import Mapping

import torch
from torch import nn

from deployments.spec import OffloadMode
from offload_core.hosting_tier import HostingTier

logger = logging.getLogger(__name__)


class Strategy(enum.Enum):
    # Layer groups stream host->device through the engine's prefetch ring (some may stay resident).
    STREAMED = "streamed"
    # The whole component lives on the device: it has no layer groups to stream.
    RESIDENT = "resident"


@dataclass(frozen=True)
class StreamingChoice:
    """The streaming knobs one offload mode means, with the reason."""

    prefetch_depth: int
    resident: float  # fraction of layers kept on the device
    hosting: HostingTier
    why: str


def streaming_choice(mode: OffloadMode, device: torch.device) -> StreamingChoice:
    if mode is OffloadMode.SPEED:
        return StreamingChoice(1, 1.0, HostingTier.PINNED, "speed: every layer resident after first use")
    if mode is OffloadMode.BALANCED:
        return StreamingChoice(2, 0.5, HostingTier.PINNED, "balanced: half the layers resident, depth-2 prefetch")
    if mode is OffloadMode.MEMORY:
        return StreamingChoice(1, 0.0, HostingTier.PAGEABLE, "memory: every layer streamed, one slot ahead")
    # AUTO without the planner: on CPU there is no transfer to hide, so spend the least device memory.
    if device.type == "cpu":
        return StreamingChoice(1, 0.0, HostingTier.PAGEABLE, "auto on cpu: nothing to hide, stream every layer")
    return StreamingChoice(2, 0.5, HostingTier.PINNED, "auto on cuda: balanced until the planner decides")


@dataclass(frozen=True)
class ComponentPlacement:
    """How one component is run; its bytes per place come from ``offload_core.report``."""

    name: str
    class_name: str
    strategy: Strategy
    layers: int
    resident_layers: int

    def to_json(self) -> dict:
        return {"name": self.name, "class": self.class_name, "strategy": self.strategy.value,
                "layers": self.layers, "resident_layers": self.resident_layers}


def _module_bytes(module: nn.Module) -> int:
    seen, total = set(), 0
    for tensor in list(module.parameters()) + list(module.buffers()):
        key = tensor.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            total += tensor.untyped_storage().nbytes()
    return total


def _streaming_module():
    """offload_core.streaming, or None where the engine is not installed (then components stay whole)."""
    try:
        return importlib.import_module("offload_core.streaming")
    except ModuleNotFoundError as exc:
        if exc.name != "offload_core.streaming":
            raise
        return None


class StageResidency:
    """The components of one stage replica, offloaded for ``device``; call around every stage use."""

    def __init__(self, components: Mapping[str, nn.Module], mode: OffloadMode, device: torch.device):
        from offload_core.layout import declared_layer_groups

        self.device, self.mode = device, mode
        self._components = dict(components)
        self._streamers: dict[str, object] = {}
        self._resident_bytes = 0
        choice = streaming_choice(mode, device)
        engine = _streaming_module()
        for name, module in self._components.items():
            groups = declared_layer_groups(module)
            if groups and engine is not None:
                self._streamers[name] = self._stream(name, module, groups, choice)
                continue
            why = (f"engine offload_core.streaming not installed, layer groups {groups} not streamed" if groups
                   else "no declared layer groups to stream")
            module.to(device)
            self._resident_bytes += _module_bytes(module)
            logger.info("component %s (%s): resident on %s, %d B: %s", name, type(module).__name__, device,
                        _module_bytes(module), why)

    def _stream(self, name: str, module: nn.Module, groups: tuple[str, ...], choice: StreamingChoice):
        streaming = _streaming_module()
        assert streaming is not None, "streaming is only chosen when the engine is installed"
        hosting = {f"{group}.{i}": choice.hosting for group in groups for i in range(len(module.get_submodule(group)))}
        config = streaming.StreamingConfig(layer_groups=groups, prefetch_depth=choice.prefetch_depth,
                                           resident=choice.resident, keep_resident=choice.resident > 0,
                                           hosting=hosting)
        streamer = streaming.apply_layer_streaming(module, self.device, config)
        logger.info("component %s (%s): streamed %d layers of %s, mode %s (%s), predicted device peak %d B",
                    name, type(module).__name__, len(streamer.layers), groups, self.mode.value, choice.why,
                    streamer.predicted_peak_bytes())
        return streamer

    # -- lifecycle ------------------------------------------------------------------------------
    def prepare_for_use(self) -> None:
        for streamer in self._streamers.values():
            streamer.reset_counters()
            streamer.meter.reset_peak()
            streamer.prepare_for_use()

    def finish_use(self) -> None:
        for streamer in self._streamers.values():
            streamer.finish_use()

    # -- figures --------------------------------------------------------------------------------
    def bytes_streamed(self) -> int:
        return sum(s.bytes_copied for s in self._streamers.values())

    def device_peak_bytes(self) -> int:
        return self._resident_bytes + sum(s.meter.peak_bytes for s in self._streamers.values())

    def predicted_peak_bytes(self) -> int:
        return self._resident_bytes + sum(s.predicted_peak_bytes() for s in self._streamers.values())

    def placements(self) -> tuple[ComponentPlacement, ...]:
        out = []
        for name, module in self._components.items():
            streamer = self._streamers.get(name)
            layers = streamer.layers if streamer is not None else ()
            strategy = Strategy.STREAMED if streamer is not None else Strategy.RESIDENT
            out.append(ComponentPlacement(name, type(module).__name__, strategy, len(layers),
                                          sum(1 for layer in layers if layer.resident)))
        return tuple(out)

    def report(self):
        """``offload_core.report.ResidencyReport``: bytes per place per component, each byte once."""
        from offload_core.report import residency_report

        return residency_report(self._components, streamers=self._streamers, device=self.device)

    def remove(self) -> None:
        for streamer in self._streamers.values():
            streamer.remove()
        self._streamers.clear()
