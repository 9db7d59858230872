"""The facts a plan is made from: layer bytes, uses, bandwidths, compute time, device and host limits.

Facts are read from the models themselves (real ones, or real-size ones on torch's ``meta``
device: shapes and dtypes are all the byte figures need) plus a few measured or configured
figures. Layers are laid out by the engine's own ``plan_layer_layout`` and slots sized by its
``RegionMap.covering``, in the engine's execution order (``offload_core.order``), so predicted
bytes equal measured ones by construction, not by a second copy of the arithmetic.

Runs in whichever process plans: ``offload-serve plan`` and each stage replica (through ``cluster/replica/plan.py``).
"""
from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Sequence

from torch import nn

from offload_core.host.tier import HostingTier
from offload_core.layout import (
    LayerLayout,
    LayoutError,
    declared_layer_groups,
    layer_parameters,
)
from offload_core.order import Trace, execution_order
from offload_core.quant import WeightFormat, layer_layout
from offload_core.tables import HostTablesConfig, TableVerdict, select_host_tables
from offload_core.tensor_parallel.sharded import local_nbytes, local_numel

logger = logging.getLogger(__name__)

# 0.1: parking 10 % of the free device memory is worth a restore copy per use (a few ms for
# 0.5 GiB at 25 GB/s); below that the restore costs more than the room it frees is worth.
DEFAULT_PARK_FRACTION = 0.1

GB = 10**9


@dataclass(frozen=True)
class LayerProfile:
    """One streamable layer as the planner sees it: the engine's own layout of it, and its size."""

    key: str  # "blocks.3"
    # Made by offload_core.layout.plan_layer_layout, the function the engine lays layers out with.
    layout: LayerLayout
    params: int  # parameter count, for FLOP estimates

    # Cached: the search reads them ~10^5 times planning a 40-layer model (frozen, so never stale).
    @functools.cached_property
    def nbytes(self) -> int:
        """Its flat buffers: what the layer takes on the device (and hosts, unless quantized)."""
        return self.layout.nbytes

    @functools.cached_property
    def host_bytes(self) -> int:
        """Its host buffers: what a PINNED or PAGEABLE layer holds and copies (8-bit where quantized)."""
        return self.layout.host_nbytes

    @functools.cached_property
    def tensor_bytes(self) -> int:
        """Bytes the tensors themselves span: what a MAPPED layer copies (tensor by tensor), and
        what the layer takes on the device when its component is plainly resident."""
        return self.layout.tensor_bytes


@dataclass(frozen=True)
class ComponentProfile:
    """One pipeline component, as the planner sees it."""

    name: str  # "transformer"
    class_name: str
    layer_groups: tuple[str, ...]  # empty: not streamable (RESIDENT or MODEL_OFFLOAD only)
    layers: tuple[LayerProfile, ...]  # in the order they run (offload_core.order)
    non_layer_bytes: int  # parameters outside the layer groups (tied ones once), hostable tables included
    table_bytes: int  # of those, the bytes of tables that qualify for host gathers
    uses_per_request: int  # forward passes over the layers per request (steps x CFG passes for a denoiser)
    # Seconds of compute per layer per use (measured on a warm-up, or estimated from FLOPs).
    compute_s_per_layer: tuple[float, ...]
    # Non-layer compute per use (embeddings, heads, norms), seconds.
    compute_s_rest: float = 0.0
    # Requests expected to share each use (a Denoiser's step batching): the weights streamed for a
    # use are paid once by the whole batch, so bytes moved per request are divided by it.
    expected_batch: float = 1.0
    # How its streamed layers are hosted (their layouts say which tensors are 8-bit).
    weights: WeightFormat = WeightFormat.NATIVE

    def __post_init__(self) -> None:
        assert len(self.compute_s_per_layer) == len(self.layers), (
            f"{self.name}: {len(self.compute_s_per_layer)} compute times for {len(self.layers)} layers; "
            "the cost model would pair times with the wrong layers")
        if self.uses_per_request < 0:
            raise ValueError(f"{self.name}: uses_per_request must be >= 0, got {self.uses_per_request}")
        if not self.expected_batch >= 1.0:
            raise ValueError(f"{self.name}: expected_batch must be >= 1, got {self.expected_batch}")

    @property
    def layer_bytes(self) -> int:
        return sum(layer.nbytes for layer in self.layers)

    @property
    def total_bytes(self) -> int:
        return self.non_layer_bytes + self.layer_bytes

    @property
    def compute_s_per_use(self) -> float:
        return sum(self.compute_s_per_layer) + self.compute_s_rest


@dataclass(frozen=True)
class Stage:
    """One stage of the pipeline and the components it runs, in order."""

    name: str
    components: tuple[str, ...]


@dataclass(frozen=True)
class LinkFacts:
    """Host->device bandwidth, bytes per second, for each way a tier's bytes reach the device."""

    pinned_Bps: float  # DMA from page-locked memory (PINNED layers)
    pageable_Bps: float  # the driver's own copy from pageable memory (model offload, parked weights, unstaged)
    measured: bool = False  # True when measured on this device, False when configured
    # Host memcpy into a pinned staging buffer pipelined with the DMA out of it (PAGEABLE and MAPPED
    # layers, staged); 0: not measured, priced at the pageable rate (what the driver's copy, itself
    # a memcpy into its staging overlapped with a DMA, reaches).
    staged_Bps: float = 0.0
    # Threads the staged rate's fills were split over (the copier runs with as many), and the best
    # host memcpy rate the probe saw into pinned memory (0: not measured).
    copier_threads: int = 1
    host_memcpy_Bps: float = 0.0

    def __post_init__(self) -> None:
        if self.pinned_Bps <= 0 or self.pageable_Bps <= 0 or self.staged_Bps < 0 or self.host_memcpy_Bps < 0:
            raise ValueError(f"bandwidths must be > 0, got pinned={self.pinned_Bps} pageable={self.pageable_Bps} "
                             f"staged={self.staged_Bps} host memcpy={self.host_memcpy_Bps}")
        if isinstance(self.copier_threads, bool) or not isinstance(self.copier_threads, int) or self.copier_threads < 1:
            raise ValueError(f"copier_threads must be an int >= 1, got {self.copier_threads!r}")

    def rate(self, tier: HostingTier) -> float:
        """Bytes per second a layer hosted in ``tier`` reaches the device at (staged for PAGEABLE, MAPPED)."""
        if tier is HostingTier.PINNED:
            return self.pinned_Bps
        return self.staged_Bps or self.pageable_Bps

    def explain(self) -> str:
        staged = (f"{self.staged_Bps / 1e9:.1f} GB/s over {self.copier_threads} copier threads" if self.staged_Bps
                  else "as pageable")
        return (f"link ({'measured' if self.measured else 'configured'}): pinned {self.pinned_Bps / 1e9:.1f} GB/s, "
                f"pageable {self.pageable_Bps / 1e9:.1f} GB/s, staged {staged}")


@dataclass(frozen=True)
class PipelineFacts:
    """Everything the planner needs, and nothing it would have to ask the machine for."""

    components: tuple[ComponentProfile, ...]
    stages: tuple[Stage, ...]
    device_capacity: int  # bytes the device may hold (weights + working set)
    link: LinkFacts
    host_lease_bytes: int  # host bytes this replica may page-lock (its lease of the node budget)
    working_set_bytes: int = 0  # activations etc. kept free of weights
    device_name: str = "device"
    park_fraction: float = DEFAULT_PARK_FRACTION  # the parking gate's fraction of headroom

    def __post_init__(self) -> None:
        for field_name in ("device_capacity", "host_lease_bytes", "working_set_bytes"):
            if getattr(self, field_name) < 0:
                raise ValueError(f"{field_name} must be >= 0, got {getattr(self, field_name)}")
        if not 0.0 <= self.park_fraction:
            raise ValueError(f"park_fraction must be >= 0, got {self.park_fraction}")
        names = [c.name for c in self.components]
        staged = [n for s in self.stages for n in s.components]
        if sorted(names) != sorted(staged):
            raise ValueError(f"stages name components {staged}, facts describe {names}: each must be in one stage")

    def component(self, name: str) -> ComponentProfile:
        for c in self.components:
            if c.name == name:
                return c
        raise KeyError(f"no component {name!r}; components: {[c.name for c in self.components]}")

    @property
    def weight_budget(self) -> int:
        return self.device_capacity - self.working_set_bytes


def layer_profile(key: str, layer: nn.Module, weights: WeightFormat = WeightFormat.NATIVE) -> LayerProfile:
    """The layer laid out exactly as the engine will lay it out (works on meta)."""
    # FLOPs count every local parameter, streamed or kept (a rank's sharded ones compute there too).
    params = sum(local_numel(p) for p in layer.parameters())
    return LayerProfile(key, layer_layout(key, layer, weights), params)


def streamable_groups(model: nn.Module, layer_groups: Sequence[str] | None) -> tuple[str, ...]:
    """The given groups, else the model's declared ones; none declared: () (resident or model offload only)."""
    if layer_groups is not None:
        return tuple(layer_groups)
    try:
        return declared_layer_groups(model)
    except LayoutError:
        return ()


def profile_component(name: str, model: nn.Module, *, uses_per_request: int,
                      compute_s_per_layer: Sequence[float] | None = None, compute_s_rest: float = 0.0,
                      layer_groups: Sequence[str] | None = None,
                      tables: HostTablesConfig = HostTablesConfig(), trace: Trace | None = None,
                      layer_order: Sequence[str] | None = None,
                      weights: WeightFormat = WeightFormat.NATIVE) -> ComponentProfile:
    """Read a component's facts from the module (real or meta). Compute defaults to 0 s per layer.

    Layers come in execution order (``trace`` or ``layer_order``, see offload_core.order), the
    order the engine streams them in; layers without parameters are not layers to stream.
    """
    groups = streamable_groups(model, layer_groups)
    layers: list[LayerProfile] = []
    in_layers: set[int] = set()
    for layer in execution_order(model, groups, trace=trace, layer_order=layer_order):
        layers.append(layer_profile(layer.key, layer.module, weights))
        in_layers.update(id(p) for _, p in layer_parameters(layer.module))
    # The rest is kept on the device, with a layer's tensor-parallel parameters (never streamed), at local bytes.
    rest = {id(p): p for p in model.parameters() if id(p) not in in_layers}
    non_layer = sum(local_nbytes(p) for p in rest.values())
    table_bytes = sum(d.nbytes for d in select_host_tables(model, tables) if d.verdict is TableVerdict.HOSTED)
    compute = tuple(compute_s_per_layer) if compute_s_per_layer is not None else (0.0,) * len(layers)
    return ComponentProfile(name, type(model).__name__, groups, tuple(layers), non_layer, table_bytes,
                            int(uses_per_request), compute, compute_s_rest, weights=weights)


def estimate_layer_compute_s(layer: LayerProfile, tokens: int, device_flops: float) -> float:
    """2 FLOPs per parameter per token (the matmuls), at the device's sustained FLOP rate.

    Attention's seq^2 term is left out, so this underestimates long-sequence compute: the planner
    then hides less transfer than it could, which errs toward more resident layers, never stalls.
    """
    return 2.0 * layer.params * tokens / device_flops


def with_compute(profile: ComponentProfile, tokens: int, device_flops: float) -> ComponentProfile:
    """The profile with per-layer compute estimated from FLOPs for ``tokens`` tokens per use."""
    times = tuple(estimate_layer_compute_s(layer, tokens, device_flops) for layer in profile.layers)
    rest_params = profile.non_layer_bytes // 2  # ~2 B per parameter (bf16); the estimate is a floor anyway
    rest = 2.0 * rest_params * tokens / device_flops
    return ComponentProfile(profile.name, profile.class_name, profile.layer_groups, profile.layers,
                            profile.non_layer_bytes, profile.table_bytes, profile.uses_per_request, times, rest,
                            profile.expected_batch, profile.weights)
