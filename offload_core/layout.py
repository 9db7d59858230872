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

from compat.torch import own_children
from offload_core.tensor_parallel.sharded import is_sharded, local_tensor

# Every tensor starts at a multiple of 512 bytes in its flat buffer. Why 512: torch's CUDA caching
# allocator hands out blocks at 512-byte granularity, so a view at a 512-aligned offset is aligned
# exactly like the freshly allocated tensor of the plain model; kernels choose vectorized paths
# and cuBLAS its algorithms by pointer alignment, so equal alignment keeps outputs bitwise equal.
# It also covers the CPU allocator's 64-byte alignment (AVX-512 loads). Cost: < 512 B per tensor.
ALIGN_BYTES = 512
# The 8-bit host buffer of a quantized layer (offload_core.quant's format), keyed like a dtype.
FP8_HOST_DTYPE = torch.float8_e4m3fn
SCALE_ITEMSIZE = 4  # float32 per-output-channel scales
# Values and scales in the FP8 buffer start at multiples of 64 bytes, not ALIGN_BYTES: only the
# elementwise widen reads them (16 B vector loads on CUDA, 64 B AVX-512 on CPU), and elementwise
# results do not depend on alignment. 512 would cost the tiny zoo's 24x24 weights 2.3x their bytes.
FP8_ALIGN_BYTES = 64

# Declared layer groups of known model classes, by class name, in the order they run.
KNOWN_LAYER_GROUPS: Mapping[str, tuple[str, ...]] = {
    "WanTransformer3DModel": ("blocks",),
    "FluxTransformer2DModel": ("transformer_blocks", "single_transformer_blocks"),
    "UMT5EncoderModel": ("encoder.block",),
    "T5EncoderModel": ("encoder.block",),
    "CLIPTextModel": ("encoder.layers",),  # transformers >= 5 dropped the `text_model` wrapper
    "AutoencoderKLWan": ("decoder.up_blocks",),
    "SD3Transformer2DModel": ("transformer_blocks",),
    "QwenImageTransformer2DModel": ("transformer_blocks",),
    # Z-Image's single-stream DiT runs its image refiner, then its caption refiner, then the main layers.
    "ZImageTransformer2DModel": ("noise_refiner", "context_refiner", "layers"),
    # The token refiner's 2 blocks (of 54 + 2) stay with the non-layer weights.
    "HunyuanVideo15Transformer3DModel": ("transformer_blocks",),
    "CLIPTextModelWithProjection": ("text_model.encoder.layers",),  # SD3.5's CLIP-L and CLIP-G
    "CLIPVisionModel": ("encoder.layers",),
    "CLIPVisionModelWithProjection": ("vision_model.encoder.layers",),  # Wan2.1 I2V's image encoder (ViT-H/14)
    "SiglipVisionModel": ("encoder.layers",),  # HunyuanVideo 1.5 I2V's image encoder (so400m; transformers >= 5)
    "Qwen3Model": ("layers",),  # Z-Image's text encoder
    "Qwen2_5_VLTextModel": ("layers",),  # HunyuanVideo 1.5's text encoder
    # Qwen-Image's text encoder: text-to-image never runs the vision tower (it stays non-layer).
    "Qwen2_5_VLForConditionalGeneration": ("model.language_model.layers",),
    "AutoencoderKLQwenImage": ("decoder.up_blocks",),
    "AutoencoderKLHunyuanVideo15": ("decoder.up_blocks",),
}
# Where the same class kept its layers in older library versions; tried when the current path
# does not resolve (transformers 4.x: CLIPTextModel.text_model.encoder.layers).
LEGACY_LAYER_GROUPS: Mapping[str, tuple[str, ...]] = {
    "CLIPTextModel": ("text_model.encoder.layers",),
    "CLIPVisionModel": ("vision_model.encoder.layers",),
    "SiglipVisionModel": ("vision_model.encoder.layers",),
}


# Set on a model while it is streamed; a second apply_layer_streaming would stream placeholders,
# and the hosting plan must read layer bytes from the host copies instead of the parameters.
STREAMER_ATTRIBUTE = "_offload_layer_streamer"
# Set on a model while its repeated blocks run compiled (offload_core.compile): streaming applied
# again under them (a replica's re-plan) widens its FP8 layers in the compiled, fused pass too.
COMPILED_ATTRIBUTE = "_offload_compiled_blocks"


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
        child = own_children(node).get(part) if isinstance(node, nn.Module) else None
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
class QuantizedMeta:
    """Where one FP8-hosted tensor's bytes and scales sit in the layer's 8-bit host buffer."""

    index: int  # into LayerLayout.tensors: the compute tensor it widens into
    q_offset: int  # byte offset of its float8 values in the FP8 host buffer (its device offset's mirror)
    scale_offset: int  # byte offset of its float32 per-output-channel scales there
    rows: int  # output channels (scales)


@dataclass(frozen=True)
class LayerLayout:
    """The flat layout of one layer: per-tensor metadata and the flat size per dtype.

    ``flat_bytes`` is the layer on the device (and on the host, unless quantized). A layer with
    ``quantized`` tensors is hosted as ``host_flat_bytes``: per compute dtype the leading run of
    its kept tensors (laid out first, at their device offsets, so one copy lands them), and one
    FP8 buffer of the quantized tensors' 8-bit values and float32 scales, widened on the device.
    """

    key: str  # "blocks.3"
    tensors: tuple[TensorMeta, ...]
    flat_bytes: tuple[tuple[torch.dtype, int], ...]  # (dtype, aligned bytes), sorted by dtype name
    quantized: tuple[QuantizedMeta, ...] = ()
    # Per compute dtype, the bytes of its kept (unquantized) tensors' leading run; () if none quantized.
    kept_bytes: tuple[tuple[torch.dtype, int], ...] = ()

    @property
    def nbytes(self) -> int:
        return sum(n for _, n in self.flat_bytes)

    @property
    def host_flat_bytes(self) -> tuple[tuple[torch.dtype, int], ...]:
        """The host buffers per dtype: ``flat_bytes``, or the kept runs plus the FP8 buffer."""
        if not self.quantized:
            return self.flat_bytes
        fp8 = align_up(max(q.scale_offset + q.rows * SCALE_ITEMSIZE for q in self.quantized))
        kept = tuple((d, n) for d, n in self.kept_bytes if n)
        return tuple(sorted((*kept, (FP8_HOST_DTYPE, fp8)), key=lambda item: str(item[0])))

    @property
    def host_nbytes(self) -> int:
        """Bytes hosted and copied host->device per copy of the layer (8-bit ones where quantized)."""
        return sum(n for _, n in self.host_flat_bytes)

    @property
    def landing_bytes(self) -> int:
        """Device bytes the FP8 buffer lands in before it is widened into the slot (0 if none quantized)."""
        return dict(self.host_flat_bytes).get(FP8_HOST_DTYPE, 0) if self.quantized else 0

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


def plan_layer_layout(key: str, params: Sequence[tuple[str, torch.Tensor]],
                      quantized: frozenset[str] = frozenset()) -> LayerLayout:
    """Lay ``params`` out as one flat buffer per dtype, each tensor at an aligned offset (meta works too).

    ``quantized``: names hosted as FP8 (``offload_core.quant.quantized_names``). Their device
    offsets come after every kept tensor of their dtype, so the kept ones form a leading run the
    host holds as is; ``tensors`` stays in the order of ``params`` either way.
    """
    cursor: dict[torch.dtype, int] = {}
    offsets: dict[int, int] = {}
    kept_first = [i for i, (name, _) in enumerate(params) if name not in quantized]
    # The quantized ones after them, tensors of one shape side by side: the widen multiplies each
    # such group by its scales at once (offload_core.fp8_widen), one launch for a Wan block's eight
    # attention projections instead of eight.
    by_shape = sorted((i for i, (name, _) in enumerate(params) if name in quantized),
                      key=lambda i: (tuple(params[i][1].shape), i))
    for passing, indices in ((False, kept_first), (True, by_shape)):
        for index in indices:
            tensor = params[index][1]
            offsets[index] = align_up(cursor.get(tensor.dtype, 0))
            cursor[tensor.dtype] = offsets[index] + storage_extent(tensor) * tensor.element_size()
        if not passing:
            kept = {d: align_up(n) for d, n in cursor.items()}
    metas = tuple(TensorMeta(name, tensor.dtype, tuple(tensor.shape), tuple(tensor.stride()), tensor.storage_offset(),
                             storage_extent(tensor), offsets[index]) for index, (name, tensor) in enumerate(params))
    flat = tuple(sorted(((d, align_up(n)) for d, n in cursor.items()), key=lambda item: str(item[0])))
    unknown = sorted(quantized - {name for name, _ in params})
    if unknown:
        raise LayoutError(f"layer {key}: quantized names {unknown} are not its parameters")
    if not quantized:
        return LayerLayout(key, metas, flat)
    q_metas = _fp8_places(metas, by_shape, kept)
    kept_runs = tuple(sorted(((d, kept.get(d, 0)) for d, _ in flat), key=lambda item: str(item[0])))
    return LayerLayout(key, metas, flat, tuple(q_metas), kept_runs)


def _fp8_places(metas: Sequence[TensorMeta], order: Sequence[int], kept: dict[torch.dtype, int]
                ) -> list[QuantizedMeta]:
    """Where each quantized tensor's 8-bit values and scales sit in the FP8 buffer.

    Per compute dtype, the values mirror the device's quantized run element for element (each at
    its device offset less the run's start, over the itemsize), so one conversion of that FP8 run
    widens every tensor of the dtype into place; the gaps between are the device's alignment
    padding, in elements. Then every tensor's float32 scales, back to back in device order.
    """
    q_offsets, fp8_cursor = {}, 0
    dtypes = sorted({metas[i].dtype for i in order}, key=str)
    for dtype in dtypes:
        base, run_start, end = align_up(fp8_cursor, FP8_ALIGN_BYTES), kept.get(dtype, 0), fp8_cursor
        for index in order:
            meta = metas[index]
            if meta.dtype == dtype:
                q_offsets[index] = base + (meta.byte_offset - run_start) // meta.dtype.itemsize
                end = q_offsets[index] + meta.extent * FP8_HOST_DTYPE.itemsize
        fp8_cursor = end
    scale_cursor, places = align_up(fp8_cursor, FP8_ALIGN_BYTES), {}
    for dtype in dtypes:
        for index in order:
            if metas[index].dtype == dtype:
                places[index] = QuantizedMeta(index, q_offsets[index], scale_cursor, metas[index].shape[0])
                scale_cursor += metas[index].shape[0] * SCALE_ITEMSIZE
    return [places[index] for index in sorted(places)]


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
    """The layer's streamable parameters, each once; buffers stay on the device.

    Tensor-parallel (DTensor) parameters are left out: streaming rebinds ``.data``, which corrupts
    a DTensor (see offload_core.tensor_parallel.sharded). They stay on the rank's device as kept weights.
    """
    return tuple((name, p) for name, p in layer.named_parameters() if not is_sharded(p))


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
    """Bytes of the distinct storages behind ``tensors`` (tied weights counted once; a DTensor's local shard)."""
    seen: dict[int, int] = {}
    for tensor in tensors:
        tensor = local_tensor(tensor)
        if tensor.numel() == 0:
            continue
        storage = tensor.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


__all__ = [
    "ALIGN_BYTES", "align_up", "check_disjoint", "COMPILED_ATTRIBUTE", "declared_layer_groups", "extent_view", "FP8_HOST_DTYPE",
    "is_placeholder", "KNOWN_LAYER_GROUPS", "layer_parameters", "LayerGroup", "LayerLayout", "LayoutError",
    "LEGACY_LAYER_GROUPS", "placeholder", "plan_layer_layout", "QuantizedMeta", "resolve_layer_group",
    "storage_extent", "tensor_view", "TensorMeta", "unique_storage_bytes",
]
