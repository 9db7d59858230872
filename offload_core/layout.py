"""Where a layer's weights are laid out: layer groups, flat buffers, per-tensor metadata, placeholders.

A *layer group* is a dotted path to an ``nn.ModuleList`` (``"blocks"``, ``"encoder.block"``);
each element is one streamed layer. A layer's parameters are laid out as ONE flat buffer per
dtype with aligned offsets (:class:`LayerLayout`), the same layout on the host and on the
device, so a layer moves host->device as one copy per dtype. While a layer is not on the
device its parameters point at a zero-element placeholder shared per (device, dtype).
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

import torch
from torch import nn

# Every tensor starts at a multiple of 512 bytes in its flat buffer. Why 512: torch's CUDA caching
# allocator hands out blocks at 512-byte granularity, so a view at a 512-aligned offset is aligned
# exactly like the freshly allocated tensor of the plain model; kernels choose vectorized paths
# and cuBLAS its algorithms by pointer alignment, so equal alignment keeps outputs bitwise equal.
# It also covers the CPU allocator's 64-byte alignment (AVX-512 loads). Cost: < 512 B per tensor.
ALIGN_BYTES = 512

# Declared layer groups of known model classes, by class name, in the order they run.
KNOWN_LAYER_GROUPS: Mapping[str, tuple[str, ...]] = {
    "WanTransformer3DModel": ("blocks",),
    "FluxTransformer2DModel": ("transformer_blocks", "single_transformer_blocks"),
    "UMT5EncoderModel": ("encoder.block",),
    "T5EncoderModel": ("encoder.block",),
    "CLIPTextModel": ("encoder.layers",),  # transformers >= 5 dropped the `text_model` wrapper
    "AutoencoderKLWan": ("decoder.up_blocks",),
}
# Where the same class kept its layers in older library versions; tried when the current path
# does not resolve (transformers 4.x: CLIPTextModel.text_model.encoder.layers).
LEGACY_LAYER_GROUPS: Mapping[str, tuple[str, ...]] = {
    "CLIPTextModel": ("text_model.encoder.layers",),
}


# Pinned staging buffers per streamer for its PAGEABLE and MAPPED layers: the host copier fills
# one while the DMA drains the other. In the simulator (25 GB/s DMA, 12 GB/s memcpy) two reach every
# steady-state ratio <= 1.05 at depth 1 and 2; one would serialise memcpy and DMA.
DEFAULT_STAGING_BUFFERS = 2

# Set on a model while it is streamed; a second apply_layer_streaming would stream placeholders,
# and the hosting plan must read layer bytes from the host copies instead of the parameters.
STREAMER_ATTRIBUTE = "_offload_layer_streamer"


class LayoutError(ValueError):
    """A layer group or layer that cannot be streamed, with the path and the reason."""


def align_up(nbytes: int, alignment: int = ALIGN_BYTES) -> int:
    return -(-int(nbytes) // alignment) * alignment


def declared_layer_groups(model: nn.Module) -> tuple[str, ...]:
    """The model's own ``offload_layer_groups``, else the known groups of its class (or a base)."""
    declared = getattr(model, "offload_layer_groups", None)
    if declared:
        return tuple(declared)
    for cls in type(model).__mro__:
        if cls.__name__ in KNOWN_LAYER_GROUPS:
            known = KNOWN_LAYER_GROUPS[cls.__name__]
            legacy = LEGACY_LAYER_GROUPS.get(cls.__name__)
            if legacy and not _resolves(model, known) and _resolves(model, legacy):
                return legacy
            return known
    raise LayoutError(
        f"{type(model).__name__} declares no layer groups: pass layer_groups=('path.to.ModuleList', ...) "
        f"or set {type(model).__name__}.offload_layer_groups (known classes: {sorted(KNOWN_LAYER_GROUPS)})"
    )


def _resolves(model: nn.Module, paths: tuple[str, ...]) -> bool:
    try:
        return all(isinstance(model.get_submodule(path), nn.ModuleList) for path in paths)
    except AttributeError:
        return False


@dataclass(frozen=True)
class LayerGroup:
    """One ``nn.ModuleList`` whose elements are streamed, in the order they run."""

    path: str
    layers: tuple[nn.Module, ...]


def resolve_layer_group(model: nn.Module, path: str) -> LayerGroup:
    """Follow ``path`` from ``model``; it must name an ``nn.ModuleList``."""
    node: object = model
    walked = []
    for part in path.split("."):
        walked.append(part)
        child = node._modules.get(part) if isinstance(node, nn.Module) else None
        if child is None:
            raise LayoutError(
                f"layer group {path!r}: {type(model).__name__} has no submodule {'.'.join(walked)!r}"
            )
        node = child
    if not isinstance(node, nn.ModuleList):
        raise LayoutError(
            f"layer group {path!r} is a {type(node).__name__}, not an nn.ModuleList of layers"
        )
    return LayerGroup(path, tuple(node))


@dataclass(frozen=True)
class TensorMeta:
    """Where one parameter lives in its layer's flat buffer, and how to rebuild it from there."""

    name: str  # parameter name inside the layer, e.g. "attn1.to_q.weight"
    dtype: torch.dtype
    shape: tuple[int, ...]
    stride: tuple[int, ...]  # kept, so non-contiguous parameters keep their strides
    storage_offset: int  # of the original tensor, in elements (for reports; the copy starts there)
    extent: int  # elements of storage the tensor spans from its first element (what is copied)
    byte_offset: int  # where that extent starts in the dtype's flat buffer (ALIGN_BYTES-aligned)

    @property
    def extent_bytes(self) -> int:
        return self.extent * _itemsize(self.dtype)


@dataclass(frozen=True)
class LayerLayout:
    """The flat layout of one layer: per-tensor metadata and the flat size per dtype."""

    key: str  # "blocks.3"
    tensors: tuple[TensorMeta, ...]
    flat_bytes: tuple[tuple[torch.dtype, int], ...]  # (dtype, aligned bytes), sorted by dtype name

    @property
    def nbytes(self) -> int:
        return sum(n for _, n in self.flat_bytes)

    @property
    def dtypes(self) -> tuple[torch.dtype, ...]:
        return tuple(d for d, _ in self.flat_bytes)

    @property
    def tensor_bytes(self) -> int:
        """The bytes the tensors themselves span (what a per-tensor copy moves)."""
        return sum(t.extent_bytes for t in self.tensors)


def _itemsize(dtype: torch.dtype) -> int:
    return dtype.itemsize


def storage_extent(tensor: torch.Tensor) -> int:
    """Elements of storage spanned by ``tensor`` from its first element (strides are >= 0 in torch)."""
    if tensor.numel() == 0:
        return 0
    return 1 + sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride()))


def extent_view(tensor: torch.Tensor) -> torch.Tensor:
    """A 1-D view of the storage run ``tensor`` spans (gaps of a strided tensor included)."""
    return tensor.as_strided((storage_extent(tensor),), (1,), tensor.storage_offset())


def plan_layer_layout(key: str, params: Sequence[tuple[str, torch.Tensor]]) -> LayerLayout:
    """Lay ``params`` out as one flat buffer per dtype, each tensor at an aligned offset (meta works too)."""
    cursor: dict[torch.dtype, int] = {}
    metas = []
    for name, tensor in params:
        offset = align_up(cursor.get(tensor.dtype, 0))
        extent = storage_extent(tensor)
        metas.append(TensorMeta(name, tensor.dtype, tuple(tensor.shape), tuple(tensor.stride()),
                                tensor.storage_offset(), extent, offset))
        cursor[tensor.dtype] = offset + extent * tensor.element_size()
    flat = tuple(sorted(((d, align_up(n)) for d, n in cursor.items()), key=lambda item: str(item[0])))
    return LayerLayout(key, tuple(metas), flat)


def slot_count(prefetch_depth: int, n_streamed: int) -> int:
    """Device slots of the prefetch ring: the running layer plus ``prefetch_depth`` ahead, but never
    more than there are streamed layers (a second slot for the same layer would hold it twice)."""
    return min(prefetch_depth + 1, n_streamed)


@dataclass(frozen=True)
class RegionMap:
    """Byte regions of one device allocation, one per dtype (a slot or a resident layer)."""

    regions: tuple[tuple[torch.dtype, int, int], ...]  # (dtype, byte offset, bytes)

    @property
    def nbytes(self) -> int:
        return sum(size for _, _, size in self.regions)

    @staticmethod
    def covering(layouts: Iterable[LayerLayout]) -> RegionMap:
        """Regions big enough for any of ``layouts``: per dtype, the largest layer's flat bytes."""
        largest: dict[torch.dtype, int] = {}
        for layout in layouts:
            for dtype, nbytes in layout.flat_bytes:
                largest[dtype] = max(largest.get(dtype, 0), nbytes)
        regions, offset = [], 0
        for dtype in sorted(largest, key=str):
            regions.append((dtype, offset, largest[dtype]))
            offset += largest[dtype]  # each size is already ALIGN_BYTES-aligned
        return RegionMap(tuple(regions))

    def carve(self, buffer: torch.Tensor) -> dict[torch.dtype, torch.Tensor]:
        """uint8 views of ``buffer``, one per dtype region."""
        assert buffer.dtype == torch.uint8 and buffer.numel() >= self.nbytes, (
            f"a {buffer.numel()} B buffer cannot hold regions of {self.nbytes} B: views would overrun it")
        return {dtype: buffer[offset:offset + size] for dtype, offset, size in self.regions}


def staging_bytes(flat_bytes: Iterable[Iterable[tuple[object, int]]], buffers: int = DEFAULT_STAGING_BUFFERS) -> int:
    """Host bytes of the staging buffers for layers with these flat layouts ((dtype, bytes) pairs).

    Each buffer is carved like a ring slot: per dtype the largest staged layer's flat bytes. There
    are ``min(buffers, layers)`` of them (more than layers would only hold a layer twice).
    """
    largest: dict[str, int] = {}
    count = 0
    for flat in flat_bytes:
        count += 1
        for dtype, nbytes in flat:
            largest[str(dtype)] = max(largest.get(str(dtype), 0), int(nbytes))
    return min(buffers, count) * sum(largest.values())


def tensor_view(flat: torch.Tensor, meta: TensorMeta) -> torch.Tensor:
    """The tensor ``meta`` describes, as a view of the uint8 flat buffer of its dtype."""
    run = flat[meta.byte_offset:meta.byte_offset + meta.extent_bytes].view(meta.dtype)
    return run.as_strided(meta.shape, meta.stride, run.storage_offset())


_placeholders: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}
_placeholders_lock = threading.Lock()


def placeholder(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """The zero-element tensor released parameters point at, one per (device, dtype).

    Zero elements, not ``(1,)``: a ``(1,)`` placeholder broadcasts silently in elementwise ops,
    so a forward that bypassed the hooks would compute garbage; an empty one fails loudly in
    every matmul, conv, norm and most elementwise ops.
    """
    key = (device, dtype)
    with _placeholders_lock:
        tensor = _placeholders.get(key)
        if tensor is None:
            tensor = torch.empty(0, dtype=dtype, device=device)
            _placeholders[key] = tensor
        return tensor


def is_placeholder(tensor: torch.Tensor) -> bool:
    return tensor.numel() == 0 and tensor.dim() == 1


def layer_parameters(layer: nn.Module) -> tuple[tuple[str, nn.Parameter], ...]:
    """The layer's parameters, each once; only parameters stream, buffers stay on the device."""
    return tuple(layer.named_parameters())


def check_disjoint(layers: Mapping[str, Sequence[nn.Parameter]], rest: Iterable[nn.Parameter]) -> None:
    """A parameter shared by two layers (or a layer and the rest) would be streamed twice."""
    owner: dict[int, str] = {}
    for key, params in layers.items():
        for param in params:
            if id(param) in owner:
                raise LayoutError(f"parameter shared by layers {owner[id(param)]} and {key}: "
                                  "a tied weight cannot be streamed per layer")
            owner[id(param)] = key
    for param in rest:
        if id(param) in owner:
            raise LayoutError(f"a parameter of layer {owner[id(param)]} is also used outside the layer groups")


def unique_storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (tied weights counted once)."""
    seen: dict[int, int] = {}
    for tensor in tensors:
        if tensor.numel() == 0:
            continue
        storage = tensor.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


__all__ = [
    "ALIGN_BYTES", "KNOWN_LAYER_GROUPS", "LEGACY_LAYER_GROUPS", "LayerGroup", "LayerLayout", "LayoutError", "RegionMap",
    "TensorMeta", "align_up", "check_disjoint", "declared_layer_groups", "extent_view", "is_placeholder",
    "layer_parameters", "placeholder", "plan_layer_layout", "resolve_layer_group", "slot_count", "storage_extent",
    "tensor_view", "unique_storage_bytes",
]
