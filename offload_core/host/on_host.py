"""What the hosting plan plans over: each component's layers as the host sees them now.

Bytes from shapes and dtypes, the engine's own flat layout (padding, per-dtype regions), and the
share of each layer that is still a view of a checkpoint mapping (copying it out costs anonymous
memory; consolidating anonymous bytes is a wash). ``host.hosting.plan_hosting`` turns these facts
into tiers under a budget.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from offload_core.host.maps import MapsSnapshot
from offload_core.host.pin_order import PinClaim
from offload_core.layout import STREAMER_ATTRIBUTE, declared_layer_groups, layer_parameters
from offload_core.order import execution_order
from offload_core.quant import WeightFormat, layer_layout


@dataclass(frozen=True)
class LayerOnHost:
    """One streamed (or resident) layer as the host sees it now."""

    key: str  # "blocks.3": the engine's layer key
    nbytes: int  # the layer's tensor bytes
    mapped_bytes: int  # views of a file mapping now: copying them out costs anonymous memory
    anon_bytes: int  # already anonymous: consolidating them frees the original, a wash
    resident: bool = False
    # Alignment gaps the consolidated flat buffer adds (the engine aligns each tensor to 512 B):
    # a few hundred KB for a 14B layer, but 12 % of a toy layer, and a ledger must not undercount.
    padding_bytes: int = 0
    # (dtype name, flat bytes) as the engine lays the layer out; sizes its share of a staging buffer.
    # Empty: one region of ``host_bytes`` (facts made by hand, single-dtype layers).
    flat_bytes: tuple[tuple[str, int], ...] = ()
    # FP8-hosted (``offload_core.quant``): quantized at load into anonymous memory of its 8-bit
    # layout's bytes (``flat_bytes`` are then the host buffers); it can never be left MAPPED.
    quantized: bool = False
    quantized_host_bytes: int = 0

    def __post_init__(self) -> None:
        assert min(self.nbytes, self.mapped_bytes, self.anon_bytes, self.padding_bytes) >= 0, \
            f"{self.key}: negative bytes would let a plan spend memory it does not account"
        if self.mapped_bytes + self.anon_bytes != self.nbytes:
            raise ValueError(f"layer {self.key}: mapped {self.mapped_bytes} B + anonymous {self.anon_bytes} B "
                             f"must equal its {self.nbytes} B")

    @property
    def host_bytes(self) -> int:
        """Bytes of the layer's own host buffers once consolidated (PINNED or PAGEABLE)."""
        return self.quantized_host_bytes if self.quantized else self.nbytes + self.padding_bytes

    @property
    def layout_bytes(self) -> tuple[tuple[str, int], ...]:
        return self.flat_bytes or (("flat", self.host_bytes),)

    @property
    def consolidation_cost(self) -> int:
        """Net anonymous bytes consolidating adds: the mapped part copied out, plus padding (FP8: its
        8-bit buffers, less the anonymous original it frees; never below 0, the lease is not a credit)."""
        if self.quantized:
            return max(0, self.quantized_host_bytes - self.anon_bytes)
        return self.mapped_bytes + self.padding_bytes


@dataclass(frozen=True)
class ComponentOnHost:
    """A component's layers in streamed order then resident, and how often a request uses it."""

    name: str
    layers: tuple[LayerOnHost, ...]
    # Denoiser: the pipeline's default num_inference_steps; encoder/decoder: 1. Required: ranking
    # by raw bytes would give a 25 GiB text encoder used once the pins a 27 GiB DiT uses 50 times.
    uses_per_request: int | None

    def __post_init__(self) -> None:
        object.__setattr__(self, "layers", tuple(self.layers))
        if not isinstance(self.uses_per_request, int) or self.uses_per_request < 1:
            raise ValueError(f"component {self.name}: uses_per_request must be an int >= 1 (the denoiser's "
                             f"num_inference_steps, 1 for an encoder/decoder), got {self.uses_per_request!r}")
        keys = [layer.key for layer in self.layers]
        if len(set(keys)) != len(keys):
            raise ValueError(f"component {self.name}: duplicate layer keys")
        flags = [layer.resident for layer in self.layers]
        if flags != sorted(flags):
            raise ValueError(f"component {self.name}: layers must be streamed first (in streamed order), "
                             f"then resident; got resident flags {flags}")

    @property
    def weight_bytes(self) -> int:
        return sum(layer.nbytes for layer in self.layers)

    def claim(self) -> PinClaim:
        """Its claim on pins: streamed layers in streamed order, then resident, by host bytes."""
        return PinClaim(self.name, self.uses_per_request,
                        tuple((l.key, l.host_bytes) for l in self.layers if not l.resident),
                        tuple((l.key, l.host_bytes) for l in self.layers if l.resident))

    @property
    def priority(self) -> int:
        """Bytes moved per request if streamed (the pin order's rank, see ``host.pin_order``)."""
        return self.claim().priority


def layers_on_host(
    name: str,
    model,
    layer_groups: Sequence[str] | None,
    uses_per_request: int | None,
    *,
    resident_keys: Sequence[str] = (),
    maps: MapsSnapshot | None = None,
    mapped_fraction: float | None = None,
    layer_order: Sequence[str] | None = None,
    weights: WeightFormat = WeightFormat.NATIVE,
) -> ComponentOnHost:
    """Per-layer facts of a model: bytes from shapes and dtypes, mapped bytes measured or given.

    Layers and their tensors are the engine's: ``layer_groups`` None means the class's declared
    groups, layers come in execution order (``layer_order``: a plan's; see offload_core.order),
    layers without parameters are none, only parameters stream (buffers stay with the non-layer
    rest), and the padding is that of the engine's flat layout.
    On a real model the mapped bytes are measured with ``maps`` (a fresh snapshot if None). A
    meta-device model has no addresses, so ``mapped_fraction`` says what share of each layer is a
    view of the checkpoint mapping (the fact the caller measured on a real host).
    """
    if mapped_fraction is not None and not 0.0 <= mapped_fraction <= 1.0:
        raise ValueError(f"mapped_fraction must be within [0, 1], got {mapped_fraction}")
    if mapped_fraction is None and maps is None:
        maps = MapsSnapshot.take()
    if getattr(model, STREAMER_ATTRIBUTE, None) is not None:
        raise ValueError(f"component {name}: facts must be taken before apply_layer_streaming; a streamed "
                         "layer's parameters are placeholders and would all measure 0 B")
    groups = declared_layer_groups(model) if layer_groups is None else tuple(layer_groups)
    streamed, resident, known = [], [], set()
    for ordered in execution_order(model, groups, layer_order=layer_order):
        key = ordered.key
        known.add(key)
        named = layer_parameters(ordered.module)
        tensors = [p.data for _, p in named]
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        mapped = (int(nbytes * mapped_fraction) if mapped_fraction is not None
                  else maps.mapped_bytes(tensors))
        layout = layer_layout(key, ordered.module, weights)
        facts = LayerOnHost(key, nbytes, mapped, nbytes - mapped, resident=key in resident_keys,
                           padding_bytes=max(0, layout.nbytes - nbytes),
                           flat_bytes=tuple((str(d), n) for d, n in layout.host_flat_bytes),
                           quantized=bool(layout.quantized), quantized_host_bytes=layout.host_nbytes)
        (resident if facts.resident else streamed).append(facts)
    unknown = set(resident_keys) - known
    if unknown:
        raise ValueError(f"component {name}: resident keys {sorted(unknown)} are not layers of {list(groups)}")
    return ComponentOnHost(name, tuple(streamed + resident), uses_per_request)
