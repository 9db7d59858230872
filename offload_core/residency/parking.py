"""Park a component's non-layer weights on the host between uses, when the device is short.

After ``finish_use`` released the streamed layers, a component still holds its non-layer
parameters on the device (embeddings, norms, projections: 0.1-1 GiB for the models we serve).
Parking copies them once to a pageable host copy, points every parameter at a zero-element
placeholder shared per (device, dtype), and restores them before the next use. Weights do not
change between inference requests, so the host copy is kept and later parks copy nothing.

The gate is real headroom for the component's next use: bytes allocations of its slot's size can
still get (driver free less neighbours' outstanding leases, whole free cached segments, cached
blocks at least a slot big; ``offload_core.streaming.headroom``). Park only if the bytes exceed
``fraction`` of it. When headroom is ample the device copy stays and any held host copy is
dropped: it would be host memory spent for nothing.
"""
from __future__ import annotations

import enum
import logging
import math
from dataclasses import dataclass, field
from typing import Iterable

import torch
from torch import nn

from offload_core.layout import placeholder
from offload_core.planner.facts import DEFAULT_PARK_FRACTION
from offload_core.streaming.device import get_device, normalize_device
from offload_core.streaming.headroom import Headroom
from offload_core.streaming.meter import DeviceWeightMeter, walked_device_bytes
from offload_core.tensor_parallel.sharded import is_sharded

logger = logging.getLogger(__name__)


class ParkVerdict(enum.Enum):
    PARKED = "parked"  # weights on the host, placeholders on the device
    KEPT = "kept"  # headroom ample: weights stay on the device, host copy dropped
    EMPTY = "empty"  # nothing to park (every parameter is a layer weight or a hosted table)


@dataclass(frozen=True)
class ParkDecision:
    """One gate decision, with the numbers that made it."""

    verdict: ParkVerdict
    nbytes: int
    headroom: int
    fraction: float
    parts: Headroom | None = field(default=None, compare=False)  # where the headroom came from, if measured

    def explain(self) -> str:
        said = (f"{self.verdict.value}: {self.nbytes} B non-layer weights vs {self.fraction:.0%} of "
                f"{self.headroom} B headroom = {int(self.fraction * self.headroom)} B")
        return said if self.parts is None else f"{said}; headroom {self.parts.explain()}"


class Parking:
    """The parkable (non-layer, non-hosted) parameters of one component and their host copies."""

    def __init__(self, name: str, module: nn.Module, device: torch.device | str,
                 exclude: Iterable[torch.Tensor] = (), fraction: float = DEFAULT_PARK_FRACTION,
                 meter: DeviceWeightMeter | None = None, min_block: int = 0):
        """``min_block``: the largest allocation the component's next use makes (a ring slot); the
        gate counts only headroom such allocations can get."""
        if not 0.0 <= fraction:
            raise ValueError(f"fraction must be >= 0, got {fraction}")
        self.name = name
        self.device = normalize_device(device)
        self.fraction = fraction
        self.min_block = min_block
        excluded = {id(t) for t in exclude}
        # Tensor-parallel parameters are never parked: park and restore rebind ``.data``, which
        # corrupts a DTensor (offload_core.tensor_parallel.sharded); they stay on the rank's device.
        unique = {id(p): p for p in module.parameters() if id(p) not in excluded and not is_sharded(p)}
        self._params: tuple[nn.Parameter, ...] = tuple(unique.values())
        self._host: dict[int, torch.Tensor] = {}
        self.parked = False
        # The component's meter is told what parking and restoring move, so it never walks; one
        # walk here finds what the parkable parameters hold on the device now.
        self._meter = meter
        self._device_bytes = walked_device_bytes(self._params, self.device)
        self.bytes_to_host = 0  # device->host copies, once per weight while the host copy is kept
        self.bytes_restored = 0  # host->device copies on restore
        self.last_decision: ParkDecision | None = None

    @property
    def nbytes(self) -> int:
        """Bytes the parkable parameters take on the device when in use."""
        if self.parked:
            return sum(h.numel() * h.element_size() for h in self._host.values())
        return sum(p.numel() * p.element_size() for p in self._params)

    def parked_tensors(self) -> tuple[torch.Tensor, ...]:
        """The host copies held now (parked or kept for a cheap next park), for the residency report."""
        return tuple(self._host.values())

    def decide(self, headroom: int, parts: Headroom | None = None) -> ParkDecision:
        nbytes = self.nbytes
        if nbytes == 0:
            verdict = ParkVerdict.EMPTY
        else:
            verdict = ParkVerdict.PARKED if nbytes > self.fraction * headroom else ParkVerdict.KEPT
        return ParkDecision(verdict, nbytes, int(headroom), self.fraction, parts)

    def park_if_it_pays(self, headroom: int | None = None) -> ParkDecision:
        """The gate: park when the bytes exceed ``fraction`` of headroom, else keep and drop host copies.

        ``headroom`` defaults to the device's real headroom for blocks of ``min_block``, measured
        now (the cached blocks' sizes only when the gate's answer depends on them). Logged once per
        change of verdict, with the numbers.
        """
        if headroom is None:
            nbytes = self.nbytes
            # Keeping needs headroom >= nbytes / fraction: more than that never changes the verdict.
            enough = math.ceil(nbytes / self.fraction) + 1 if self.fraction > 0 else None
            parts = get_device(self.device).headroom(
                self.min_block, settled=None if enough is None else (lambda room: room.usable_bytes >= enough))
            decision = self.decide(parts.usable_bytes, parts)
        else:
            decision = self.decide(headroom)
        if self.last_decision is None or decision.verdict is not self.last_decision.verdict:
            logger.info("parking %s: %s", self.name, decision.explain())
        self.last_decision = decision
        if decision.verdict is ParkVerdict.PARKED:
            self.park()
        elif decision.verdict is ParkVerdict.KEPT:
            self._host.clear()
        return decision

    def park(self) -> None:
        if self.parked:
            return
        for p in self._params:
            if id(p) not in self._host:  # copied once: a kept host copy is reused by later parks
                host = torch.empty(p.shape, dtype=p.dtype, device="cpu")
                host.copy_(p.data)
                self._host[id(p)] = host
                self.bytes_to_host += host.numel() * host.element_size()
            p.data = placeholder(self.device, p.dtype)
        self._left_device()

    def _left_device(self) -> None:
        if self._meter is not None:
            self._meter.moved(-self._device_bytes)
        self._device_bytes = 0
        self.parked = True

    def park_from_host(self) -> None:
        """Start parked from weights that are still host tensors: they become the host copies, uncopied.

        For a component that starts off the device (model offload): moving it to the device only
        to copy it back would need its whole size free on the device for nothing.
        """
        assert not self.parked, f"{self.name}: already parked"
        for p in self._params:
            assert p.device.type == "cpu", f"{self.name}: {tuple(p.shape)} is on {p.device}, not a host tensor"
            self._host[id(p)] = p.data
            p.data = placeholder(self.device, p.dtype)
        self._left_device()

    def restore(self) -> None:
        """Bring parked weights back before use; a fresh device allocation, never a host alias."""
        if not self.parked:
            return
        restored_bytes = 0
        for p in self._params:
            host = self._host[id(p)]
            restored = torch.empty(host.shape, dtype=host.dtype, device=self.device)
            restored.copy_(host, non_blocking=True)
            p.data = restored
            restored_bytes += host.numel() * host.element_size()
        self.bytes_restored += restored_bytes
        self._device_bytes = restored_bytes  # one fresh allocation per parameter
        if self._meter is not None:
            self._meter.moved(restored_bytes)
        self.parked = False
