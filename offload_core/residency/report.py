"""Where the weights are: bytes on the device, host pinned / mapped / pageable, and parked.

Each component's tensors are walked once, in this order, and every byte is counted at most once
(the first place that claims it wins):

1. the streamer's layers (``host_tensors()`` with the layer's ``.tier``): PINNED layers count as
   pinned (planned and accounted pinned even where no CUDA can page-lock them); other host bytes
   are classified by the maps snapshot, so a layer planned MAPPED whose weights were in fact
   copied out (a dtype conversion) shows as pageable, not as the plan hoped; then its pinned
   staging buffers (for PAGEABLE and MAPPED layers), counted as pinned and shown apart too;
2. the parking object's ``parked_tensors()``: host copies of parked non-layer weights;
3. the model's own parameters and buffers: on ``device`` -> device bytes, else host by backing.

Bytes are counted per storage (the allocation is what occupies memory: a layer's flat buffer
with its alignment padding, a tensor's own slice of a safetensors mapping), deduplicated by the
storage's byte range: a flat buffer backs many parameter views, tied weights share one storage,
and shared placeholders back every released parameter. Overlapping ranges are merged, so each
byte counts once.
"""
from __future__ import annotations

import bisect
import logging
from dataclasses import asdict, dataclass
from typing import Iterable, Mapping

import torch

from offload_core.host.maps import Backing, MapsSnapshot
from offload_core.host.tier import HostingTier
from offload_core.shared_store.layer import SharedHostLayer
from offload_core.tables import TableDecision
from offload_core.tensor_parallel.sharded import local_tensor

logger = logging.getLogger(__name__)

GiB = 1024**3


@dataclass(frozen=True)
class ComponentResidency:
    """One component's bytes per place, each byte counted once."""

    name: str
    device_bytes: int
    host_pinned_bytes: int
    host_mapped_bytes: int
    host_pageable_bytes: int
    parked_bytes: int
    # Streamed layers per planned tier, e.g. (("pinned", 4), ("pageable", 0), ("mapped", 36)).
    layer_tiers: tuple[tuple[str, int], ...] = ()
    # Layers hosted from a node weight store (shared memory, one copy per node): mapped read-only
    # here, pinned or pageable per their tier, and not this replica's own anonymous memory.
    host_shared_bytes: int = 0
    # Of host_pinned_bytes, the staging buffers PAGEABLE and MAPPED layers are copied through.
    host_staging_bytes: int = 0
    # Every declared token table's verdict (hosted, sharded, too small...) and why, when host tables were asked.
    tables: tuple[TableDecision, ...] = ()
    # How streamed layers are hosted ("native", "fp8"), and the host bytes their layouts take
    # that way and as loaded: the difference is what 8-bit hosting saves (and each copy of it too).
    weights: str = "native"
    layer_host_bytes: int = 0
    layer_native_bytes: int = 0

    @property
    def host_bytes(self) -> int:
        return (self.host_pinned_bytes + self.host_mapped_bytes + self.host_pageable_bytes + self.parked_bytes
                + self.host_shared_bytes)

    def to_json(self) -> dict:
        data = asdict(self)
        data["layer_tiers"] = dict(self.layer_tiers)
        data["tables"] = [{"path": t.path, "verdict": t.verdict.value, "bytes": t.nbytes, "reason": t.reason}
                          for t in self.tables]
        return data

    def log_line(self) -> str:
        tiers = ", ".join(f"{n} {t}" for t, n in self.layer_tiers) or "no streamed layers"
        tables = "".join(f"; table {t.path}: {t.verdict.value}" for t in self.tables)
        return (f"residency {self.name}: device {_gib(self.device_bytes)}, host pinned "
                f"{_gib(self.host_pinned_bytes)} (staging {_gib(self.host_staging_bytes)}), mapped "
                f"{_gib(self.host_mapped_bytes)}, pageable "
                f"{_gib(self.host_pageable_bytes)}, parked {_gib(self.parked_bytes)}, shared "
                f"{_gib(self.host_shared_bytes)}; layers: {tiers}{tables}"
                + (f"; {self.weights} weights: layers host {_gib(self.layer_host_bytes)} instead of "
                   f"{_gib(self.layer_native_bytes)}" if self.weights != "native" else ""))


@dataclass(frozen=True)
class ResidencyReport:
    """Every component of a replica; ``to_json()`` is what the API returns."""

    components: tuple[ComponentResidency, ...]

    def component(self, name: str) -> ComponentResidency:
        for c in self.components:
            if c.name == name:
                return c
        raise KeyError(f"no component {name!r} in the residency report")

    def total(self, field: str) -> int:
        return sum(getattr(c, field) for c in self.components)

    def to_json(self) -> dict:
        """A JSON-ready dict (plain ints and strings), as FastAPI and Ray hand it on."""
        fields = ("device_bytes", "host_pinned_bytes", "host_mapped_bytes", "host_pageable_bytes", "parked_bytes",
                  "host_shared_bytes", "host_staging_bytes")
        return {"components": [c.to_json() for c in self.components],
                "totals": {f: self.total(f) for f in fields}}

    def log_line(self) -> str:
        return " | ".join(c.log_line() for c in self.components) or "residency: no components"


class _ByteRanges:
    """Disjoint, sorted [start, end) ranges of one address space; adding returns the new bytes."""

    def __init__(self) -> None:
        self._starts: list[int] = []
        self._ends: list[int] = []

    def claim(self, start: int, end: int) -> int:
        i = bisect.bisect_right(self._ends, start)  # first range ending after start
        new_start, new_end, covered = start, end, 0
        j = i
        while j < len(self._starts) and self._starts[j] < end:
            covered += min(end, self._ends[j]) - max(start, self._starts[j])
            new_start, new_end = min(new_start, self._starts[j]), max(new_end, self._ends[j])
            j += 1
        self._starts[i:j], self._ends[i:j] = [new_start], [new_end]
        return (end - start) - covered


def _extent(tensor: torch.Tensor) -> tuple[int, int] | None:
    """The byte range of the storage behind ``tensor``; None for empty or meta tensors."""
    if tensor.numel() == 0 or tensor.device.type == "meta":
        return None
    storage = tensor.untyped_storage()
    return storage.data_ptr(), storage.data_ptr() + storage.nbytes()


class _Tally:
    """Byte counts per place for one component, deduplicated per address space."""

    def __init__(self, maps: MapsSnapshot, device: torch.device | None):
        self.maps, self.device = maps, device
        self.bytes = {k: 0 for k in ("device", "pinned", "mapped", "pageable", "parked", "shared")}
        self._ranges: dict[str, _ByteRanges] = {}

    def add(self, tensor: torch.Tensor, place: str) -> None:
        extent = _extent(tensor)
        if extent is None:
            return
        ranges = self._ranges.setdefault(str(tensor.device), _ByteRanges())
        self.bytes[place] += ranges.claim(*extent)

    def host_place(self, tensor: torch.Tensor) -> str:
        return "mapped" if self.maps.tensor_backing(tensor) is Backing.FILE else "pageable"

    def model_place(self, tensor: torch.Tensor) -> str:
        on_device = (tensor.device == self.device) if self.device is not None else tensor.device.type != "cpu"
        return "device" if on_device else self.host_place(tensor)


def component_residency(name: str, model: torch.nn.Module, *, streamer=None, parking=None,
                        device: torch.device | str | None = None, maps: MapsSnapshot | None = None,
                        tables: tuple[TableDecision, ...] = ()) -> ComponentResidency:
    """Measure one component. ``device``: where the engine runs it (CPU counts as a device too)."""
    tally = _Tally(maps or MapsSnapshot.take(), None if device is None else torch.device(device))
    tiers = {t: 0 for t in HostingTier}
    for layer in (streamer.layers if streamer is not None else ()):
        tiers[layer.tier] += 1
        for tensor in layer.host_tensors():
            if isinstance(layer.host, SharedHostLayer):
                tally.add(tensor, "shared")
            else:
                tally.add(tensor, "pinned" if layer.tier is HostingTier.PINNED else tally.host_place(tensor))
    pinned_before = tally.bytes["pinned"]
    staging = getattr(streamer, "staging", None)
    for tensor in (staging.host_tensors() if staging is not None else ()):
        tally.add(tensor, "pinned")
    staging_bytes = tally.bytes["pinned"] - pinned_before
    for tensor in (parking.parked_tensors() if parking is not None else ()):
        tally.add(tensor, "parked")
    for tensor in _model_tensors(model):
        tally.add(tensor, tally.model_place(tensor))
    b = tally.bytes
    layer_tiers = tuple((t.value, n) for t, n in tiers.items()) if streamer is not None else ()
    layers = streamer.layers if streamer is not None else ()
    weights = streamer.config.weights.value if streamer is not None else "native"
    return ComponentResidency(name, b["device"], b["pinned"], b["mapped"], b["pageable"], b["parked"], layer_tiers,
                              b["shared"], staging_bytes, tuple(tables), weights,
                              sum(layer.layout.host_nbytes for layer in layers), sum(layer.layout.nbytes for layer in layers))


def residency_report(models: Mapping[str, torch.nn.Module], *, streamers: Mapping[str, object] | None = None,
                     parkings: Mapping[str, object] | None = None,
                     device: torch.device | str | None = None,
                     tables: Mapping[str, tuple[TableDecision, ...]] | None = None) -> ResidencyReport:
    """The report for every component of a replica, from one maps snapshot; logged in one line."""
    maps = MapsSnapshot.take()
    streamers, parkings, tables = streamers or {}, parkings or {}, tables or {}
    unknown = (set(streamers) | set(parkings) | set(tables)) - set(models)
    if unknown:
        raise ValueError(f"streamers/parkings name components that are not given: {sorted(unknown)}")
    report = ResidencyReport(tuple(
        component_residency(name, model, streamer=streamers.get(name), parking=parkings.get(name),
                            device=device, maps=maps, tables=tables.get(name, ()))
        for name, model in models.items()))
    logger.info(report.log_line())
    return report


def _model_tensors(model: torch.nn.Module) -> Iterable[torch.Tensor]:
    yield from (local_tensor(p.data) for p in model.parameters())  # a rank's shard of a DTensor
    yield from model.buffers()


def _gib(nbytes: int) -> str:
    return f"{nbytes / GiB:.2f} GiB"
