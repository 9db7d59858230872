"""8-bit host weights: which tensors are quantized, the FP8 quantize at load and the widen on the device.

Pure torch, no runtime state: the engine (``streaming.host_layer``), the planner (on ``meta``) and
the tests' fake-quantized reference all decide and compute through these functions, so the
streamed FP8 model equals the reference bit for bit by construction.

Format (``WeightFormat.FP8``): a quantized weight is stored as ``float8_e4m3fn`` with one float32
scale per output channel (dim 0), ``w ~= q * scale``, the scale the power of two that maps the
row's absolute maximum into (224, 448] (448: e4m3's largest value; power-of-two scales as in the
OCP MX formats' E8M0). The widen is ``out.copy_(q); out.mul_(scale)``: the fp8 -> compute-dtype
copy is exact (every e4m3 value is a bf16/fp16/fp32 value) and so is a multiply by a power of two
(bar bf16/fp16 under- or overflow), so the widened weight is exactly ``q * scale``, and
quantizing it again widens to the very same weights (a row whose maximum rounded down to 224
gets half the scale and twice the values, exactly): a replica that re-applies its plan (the
warm-up's replan, after ``remove()`` gave the widened weights back) computes the same, never
rounding twice. torch 2.13 has no mixed fp8 x
fp32 multiply (``Promotion for Float8 Types is not supported``), so the widen is two kernels: the
conversion (a table lookup on CPU, see ``_CPU_CHUNK_ELEMENTS``) and a multiply by the scale in the
compute dtype (a power of two: exact in bf16 and fp32, and in fp16 within its range).

Which tensors: the ``weight`` of ``nn.Linear`` and ``nn.ConvNd`` modules (2+ dims, contiguous,
floating point, at least ``MIN_QUANTIZED_ELEMENTS`` elements). They are 99.95 % of a Wan2.1-14B
block's bytes (99.97 % of FLUX.1-dev's; measured on meta) and feed a matmul, where a per-row scale is a per-output-channel factor. Everything
else stays in its dtype: norms' weights and biases (1-D) set the scale of
activations directly; modulation tables (``scale_shift_table``) and embeddings are tables whose
rows are read, not reduced; a bias is added after the matmul, at full precision.
"""
from __future__ import annotations

import enum
from typing import Iterable, Sequence

import torch
from torch import nn

from offload_core.layout import FP8_HOST_DTYPE, SCALE_ITEMSIZE, LayerLayout, layer_parameters, plan_layer_layout

FP8_DTYPE = FP8_HOST_DTYPE
SCALE_DTYPE = torch.float32
assert SCALE_DTYPE.itemsize == SCALE_ITEMSIZE
# Largest finite e4m3fn value: a row's absolute maximum maps onto it.
FP8_MAX = 448.0
# Below 256 elements a tensor's scale row (4 B per output channel) and its two widen kernels
# (~5 us of launches each on CUDA) outweigh the bytes saved; the tiny zoo's 16x16 linears still
# qualify, so its tests exercise the quantized path.
MIN_QUANTIZED_ELEMENTS = 256
_FLOATS = (torch.float32, torch.bfloat16, torch.float16)
_QUANTIZED_MODULES = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)


class WeightFormat(enum.Enum):
    """How a stage's streamed layers are hosted and copied."""

    NATIVE = "native"  # as loaded (bf16 for the real models): host bytes = device bytes
    FP8 = "fp8"  # Linear/Conv weights as e4m3 + per-channel float32 scales, widened in the slot

    @classmethod
    def parse(cls, value: object) -> WeightFormat:
        if isinstance(value, cls):
            return value
        if value is None:
            return cls.NATIVE
        try:
            return cls(value)
        except ValueError:
            raise ValueError(f"weights must be one of {[f.value for f in cls]}, got {value!r}") from None


def quantizable(module: nn.Module, name: str, tensor: torch.Tensor) -> bool:
    """Whether parameter ``name`` (of ``module``, its owner) is stored as FP8 (see the module docstring)."""
    return (name == "weight" and isinstance(module, _QUANTIZED_MODULES) and tensor.dim() >= 2
            and tensor.dtype in _FLOATS and tensor.numel() >= MIN_QUANTIZED_ELEMENTS
            and tensor.is_contiguous())


def quantized_names(layer: nn.Module, weights: WeightFormat) -> frozenset[str]:
    """The names (relative to ``layer``) of the parameters stored as FP8 under ``weights`` (works on meta)."""
    if weights is WeightFormat.NATIVE:
        return frozenset()
    names = set()
    for module_name, module in layer.named_modules():
        for name, param in module.named_parameters(recurse=False):
            if quantizable(module, name, param):
                names.add(f"{module_name}.{name}" if module_name else name)
    # Only what streams: a tensor-parallel (DTensor) weight stays on its rank's device as it is.
    return frozenset(names & {name for name, _ in layer_parameters(layer)})


def layer_layout(key: str, layer: nn.Module, weights: WeightFormat = WeightFormat.NATIVE) -> LayerLayout:
    """The layer's layout under ``weights``: the one function the engine, the planner and the host facts lay out with."""
    named = layer_parameters(layer)
    return plan_layer_layout(key, [(n, p.data) for n, p in named], quantized_names(layer, weights))


def quantize_fp8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scale)``: ``q`` float8_e4m3fn shaped like ``weight``, ``scale`` float32 per output channel.

    Computed in float32 on the tensor's own device; deterministic (a division and a cast). A row of
    zeros gets scale 1 (its q is all zeros), never a 0/0.
    """
    w = weight.detach().to(torch.float32)
    amax = w.abs().reshape(w.shape[0], -1).amax(dim=1)
    mantissa, exponent = torch.frexp(amax / FP8_MAX)  # amax / 448 = m * 2**e, m in [0.5, 1)
    # The least power of two >= amax / 448: 2**e, or 2**(e - 1) when amax / 448 is one already.
    scale = torch.ldexp(torch.ones_like(amax), exponent - (mantissa == 0.5).to(exponent.dtype))
    scale = torch.where(amax > 0, scale, torch.ones_like(amax))
    q = (w / scale.reshape(-1, *([1] * (w.dim() - 1)))).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale.to(SCALE_DTYPE)


# On CPU, torch 2.13 converts float8 elementwise at ~88 ns per element (1.2 s for a 1536x8960
# weight, 1 thread), and a bf16 x fp32 multiply promotes per element (2.2 s); a 256-entry table
# gathered with int32 indices takes 0.41 s and a same-dtype multiply 0.06 s, bit for bit the same.
# Chunks bound the int32 indices' transient memory (4 B per element) to 16 MiB.
_CPU_CHUNK_ELEMENTS = 1 << 22


def widen_fp8(q: torch.Tensor, scale: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Write ``q * scale`` into ``out`` (the compute dtype, shaped like ``q``): the engine's and the reference's one widen."""
    convert_fp8(q, out)
    factor = scale.to(out.dtype)
    if not torch.equal(factor.to(scale.dtype), scale):  # a power of two outside fp16's range: multiply in fp32
        factor = scale
    out.mul_(factor.reshape(-1, *([1] * (q.dim() - 1))))
    return out


def convert_fp8(q: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out`` (the compute dtype, shaped like ``q``) holds ``q``'s values, unscaled: exact either way."""
    if out.device.type == "cpu" and out.is_contiguous():
        table, flat, codes = _fp8_table(out.dtype), out.view(-1), q.reshape(-1).view(torch.uint8)
        for start in range(0, flat.numel(), _CPU_CHUNK_ELEMENTS):
            end = min(start + _CPU_CHUNK_ELEMENTS, flat.numel())
            torch.index_select(table, 0, codes[start:end].to(torch.int32), out=flat[start:end])
    else:
        out.copy_(q)
    return out


_tables: dict[torch.dtype, torch.Tensor] = {}


def _fp8_table(dtype: torch.dtype) -> torch.Tensor:
    """Every float8_e4m3fn code's value in ``dtype`` (the cast's own results), made once per dtype."""
    table = _tables.get(dtype)
    if table is None:
        table = _tables[dtype] = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(FP8_DTYPE).to(dtype)
    return table


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A fresh tensor of ``dtype`` holding ``q * scale``, through :func:`widen_fp8`."""
    return widen_fp8(q, scale, torch.empty(q.shape, dtype=dtype, device=q.device))


def fake_quantize_(layers: Iterable[nn.Module], weights: WeightFormat = WeightFormat.FP8) -> int:
    """The reference: replace each quantizable weight of ``layers`` by quantize -> widen, in place.

    The plain model whose weights went through the same loss the streamed FP8 model has; a
    streamed FP8 run must equal its output bit for bit. Returns the number of tensors changed.
    """
    changed = 0
    with torch.no_grad():
        for layer in layers:
            names = quantized_names(layer, weights)
            for name, param in layer.named_parameters():
                if name in names:
                    param.data = dequantize_fp8(*quantize_fp8(param.data), param.dtype)
                    changed += 1
    return changed


def fp8_bytes(shape: Sequence[int]) -> tuple[int, int]:
    """(q bytes, scale bytes) of a quantized tensor of ``shape``."""
    numel = 1
    for size in shape:
        numel *= int(size)
    return numel * FP8_DTYPE.itemsize, int(shape[0]) * SCALE_DTYPE.itemsize
