"""A quantized layer widened at once: one conversion per compute dtype, one scale multiply per group.

Pure torch, no runtime state; the engine (``streaming.host_layer``) calls it on the copy stream of
whichever thread issues the layer's copy. Widening tensor by tensor (``quant.widen_fp8``) costs
about five kernel launches per quantized tensor and, on CUDA, a host synchronisation (the check
whether a scale is exact in the compute dtype reads the device): on an H200 a real-size
Wan2.1-1.3B step at one latent frame spent ~31 ms of its launch thread in them against ~14 ms in
bf16, and FP8 came out 1.59x slower than bf16 with half the bytes.

The FP8 buffer is laid out for it (``layout._fp8_places``): per compute dtype the 8-bit values
mirror the device's quantized run, so one conversion (``copy_`` on CUDA, the exact table lookup
on CPU) widens the whole run into place; tensors of one shape sit side by side with equal
spacing and their scales back to back, so one broadcast multiply scales the group. The result
is bit for bit ``quant.widen_fp8``'s, tensor by tensor: the conversion is elementwise, and a
multiply by a power-of-two float32 scale rounds to the compute dtype exactly as a multiply by the
same scale in that dtype does (both compute in float32). On CUDA the float32 scales are used as
they are (no device read to decide); on CPU they are narrowed where exact, as ``widen_fp8`` does,
because a promoted multiply is several times slower there.

:attr:`WidenMode.FUSED` widens each group in one pass instead (``fused_operands``,
``widen_groups``, compiled once per layer layout by torch.compile): the eager way converts
the run (1 B read, 2 B written per element) and then scales it (2 B read, 2 B written), 7 B per
element in two kernels; fused it reads the 8-bit value and writes the result, 3 B. On the H200
the widen's kernels were ~9.5 ms of SM time per 1.3B step beside compute (FP8 1.106x bf16 where
compute-bound, target 1.05). The same bits: the multiply was already computed in float32 (the
promoted bf16 x float32 multiply) from a conversion that is exact (every e4m3 value is a bf16
and an fp16 value), and the one rounding is the final one either way.
"""
from __future__ import annotations

import dataclasses
import enum
import functools
import logging
import os
import shutil
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

import torch

from compat.torch import raise_recompile_limit
from offload_core.layout import FP8_HOST_DTYPE, SCALE_ITEMSIZE, LayerLayout, align_up
from offload_core.quant import FP8_DTYPE, SCALE_DTYPE, convert_fp8

logger = logging.getLogger(__name__)

# Compiled entries of the fused widen: one per quantized layer layout and grad mode a process runs
# (a handful per stage); dynamo's default 8 would fall back to eager, silently, after the 8th.
FUSED_RECOMPILE_LIMIT = 64
# Triton converts float8_e4m3fn from compute capability 8.9 (Ada, Hopper) on; inductor's own float8
# tests are skipped below it. On an A100 (8.0) the fused widen would fail to compile at a request.
FUSED_MIN_CAPABILITY = (8, 9)


class WidenMode(str, enum.Enum):
    """How quantized layers widen on the device. EAGER: a conversion per run, then a multiply per group
    (two passes, 1 + groups launches). FUSED: one compiled pass per group (3 B moved per element, not 7)."""

    EAGER = "eager"
    FUSED = "fused"


@dataclass(frozen=True)
class WidenRun:
    """One compute dtype's quantized run: the FP8 bytes [fp8_start, fp8_end) widen into device bytes from device_start."""

    dtype: torch.dtype
    fp8_start: int
    fp8_end: int
    device_start: int


@dataclass(frozen=True)
class ScaleGroup:
    """``count`` tensors of one shape ``rows x cols``, ``spacing`` elements apart from ``device_offset``
    (bytes) in the dtype's region and from ``fp8_offset`` (bytes, one per element) in the FP8 buffer;
    their scales back to back from ``scale_offset`` there."""

    dtype: torch.dtype
    count: int
    rows: int
    cols: int
    device_offset: int
    spacing: int
    scale_offset: int
    fp8_offset: int


@dataclass(frozen=True)
class WidenPlan:
    runs: tuple[WidenRun, ...]
    groups: tuple[ScaleGroup, ...]

    @property
    def launches(self) -> int:
        """Kernels one widen launches on CUDA: a conversion per run, a multiply per group."""
        return len(self.runs) + len(self.groups)


def widen_plan(layout: LayerLayout) -> WidenPlan:
    """The runs and groups of ``layout``'s quantized tensors (a host layer makes its own once: hashing a
    layout per widen would cost the launch thread more than the lookup saves)."""
    placed = sorted(layout.quantized, key=lambda q: (str(layout.tensors[q.index].dtype),
                                                     layout.tensors[q.index].byte_offset))
    runs, groups = [], []
    for q in placed:
        meta = layout.tensors[q.index]
        end = q.q_offset + meta.extent * FP8_HOST_DTYPE.itemsize
        if runs and runs[-1].dtype == meta.dtype:
            runs[-1] = WidenRun(meta.dtype, runs[-1].fp8_start, end, runs[-1].device_start)
        else:
            runs.append(WidenRun(meta.dtype, q.q_offset, end, meta.byte_offset))
        rows, cols = meta.shape[0], meta.extent // meta.shape[0]
        last = groups[-1] if groups else None
        if (last is not None and last.dtype == meta.dtype and (last.rows, last.cols) == (rows, cols)
                and q.scale_offset == last.scale_offset + last.count * rows * SCALE_ITEMSIZE
                and meta.byte_offset == last.device_offset + last.count * last.spacing * meta.dtype.itemsize
                and q.q_offset == last.fp8_offset + last.count * last.spacing):
            groups[-1] = dataclasses.replace(last, count=last.count + 1)
            continue
        # spacing: the layout's rule for the next tensor of this size (ALIGN_BYTES-aligned offsets)
        spacing = align_up(meta.extent_bytes) // meta.dtype.itemsize
        groups.append(ScaleGroup(meta.dtype, 1, rows, cols, meta.byte_offset, spacing, q.scale_offset, q.q_offset))
    return WidenPlan(tuple(runs), tuple(groups))


def group_operands(group: ScaleGroup, regions: Mapping[torch.dtype, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """``group``'s tensors in their slot as one ``[count, rows, cols]`` view, and their float32 scales
    (``count x rows``, flat) in the landed FP8 buffer: what the group's one multiply takes."""
    itemsize = group.dtype.itemsize
    span = ((group.count - 1) * group.spacing + group.rows * group.cols) * itemsize
    flat = regions[group.dtype][group.device_offset:group.device_offset + span].view(group.dtype)
    out = flat.as_strided((group.count, group.rows, group.cols), (group.spacing, group.cols, 1),
                          flat.storage_offset())
    scale_bytes = group.count * group.rows * SCALE_ITEMSIZE
    landing = regions[FP8_HOST_DTYPE]
    return out, landing[group.scale_offset:group.scale_offset + scale_bytes].view(SCALE_DTYPE)


def _factor(scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The scales to multiply by: float32 on CUDA (no device read); on CPU narrowed to ``dtype`` where exact."""
    if scales.device.type != "cpu":
        return scales
    narrow = scales.to(dtype)
    return narrow if torch.equal(narrow.to(SCALE_DTYPE), scales) else scales


def fused_operands(plan: WidenPlan, regions: Mapping[torch.dtype, torch.Tensor]
                   ) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """Per group: its 8-bit values as ``[count, rows, cols]`` in the landed FP8 buffer, its float32
    scales, and its tensors in the slot (:func:`group_operands`): what :func:`widen_groups` takes."""
    values, scales, outs = [], [], []
    landing = regions[FP8_HOST_DTYPE]
    for group in plan.groups:
        out, group_scales = group_operands(group, regions)
        span = (group.count - 1) * group.spacing + group.rows * group.cols
        flat = landing[group.fp8_offset:group.fp8_offset + span].view(FP8_DTYPE)
        values.append(flat.as_strided((group.count, group.rows, group.cols), (group.spacing, group.cols, 1),
                                      flat.storage_offset()))
        scales.append(group_scales)
        outs.append(out)
    return values, scales, outs


def widen_groups(values: Sequence[torch.Tensor], scales: Sequence[torch.Tensor], outs: Sequence[torch.Tensor]) -> None:
    """``out = value x scale`` per group, computed in float32 and rounded once: what torch.compile fuses
    into one pass per group (eager, this is three: use :func:`widen_layer` there)."""
    for value, scale, out in zip(values, scales, outs):
        out.copy_(value.to(torch.float32).mul(scale.view(value.shape[0], value.shape[1], 1)).to(out.dtype))


def fused_refusal(device: torch.device) -> str | None:
    """Why the fused widen cannot run on ``device``; None when it can."""
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        if (major, minor) < FUSED_MIN_CAPABILITY:
            return (f"Triton converts float8_e4m3fn from compute capability {FUSED_MIN_CAPABILITY[0]}."
                    f"{FUSED_MIN_CAPABILITY[1]} on; {device} is {major}.{minor}")
        return None
    if device.type == "cpu":
        if os.environ.get("CXX") or any(shutil.which(cxx) for cxx in ("g++", "c++", "clang++")):
            return None
        return "inductor's CPU backend compiles C++, and no C++ compiler is on PATH (nor CXX set)"
    return f"no fused widen on {device.type}"


@functools.cache
def _fused_kernel() -> Callable[..., None]:
    limit = raise_recompile_limit(FUSED_RECOMPILE_LIMIT)
    logger.info("fp8 widen: fused, compiled once per quantized layer layout (3 B moved per element "
                "against 7 eager); recompile limit %d", limit)
    return torch.compile(widen_groups, fullgraph=True, dynamic=False)


class BoundWiden:
    """One layer's widen into one set of regions, its operand views made once: the ring keeps one per
    place (window offset x landing buffer), so an issue there only launches. Rebuilt at every copy, a
    real-size block's views (3 groups, 1 run) cost the launch thread 51-81 us per widen on the 2-core
    CI VM (bench/widen_launches.py, on meta)."""

    __slots__ = ("_runs", "_groups", "_fused")

    def __init__(self, plan: WidenPlan, regions: Mapping[torch.dtype, torch.Tensor], mode: WidenMode = WidenMode.EAGER):
        self._fused = fused_operands(plan, regions) if mode is WidenMode.FUSED else None
        eager = self._fused is None
        landing = regions[FP8_HOST_DTYPE]
        # per run: its 8-bit values and, as many elements on, its place in the compute dtype's region
        self._runs = tuple((landing[r.fp8_start:r.fp8_end].view(FP8_DTYPE),
                            regions[r.dtype][r.device_start:r.device_start + (r.fp8_end - r.fp8_start) * r.dtype.itemsize]
                            .view(r.dtype)) for r in plan.runs) if eager else ()
        self._groups = tuple((*group_operands(g, regions), g.dtype, (g.count, g.rows, 1))
                             for g in plan.groups) if eager else ()

    def __call__(self) -> None:
        if self._fused is not None:
            _fused_kernel()(*self._fused)
            return
        for q, out in self._runs:
            convert_fp8(q, out)
        for out, scales, dtype, shape in self._groups:
            out.mul_(_factor(scales, dtype).view(shape))


def widen_layer(plan: WidenPlan, regions: Mapping[torch.dtype, torch.Tensor],
                mode: WidenMode = WidenMode.EAGER) -> None:
    """Widen every quantized tensor of ``plan`` (:func:`widen_plan` of the layer's layout) from
    ``regions[FP8_HOST_DTYPE]`` (the landed FP8 buffer) into its place in ``regions`` (uint8 per dtype):
    eager, one conversion per run and one multiply per group; fused, one compiled pass per group."""
    BoundWiden(plan, regions, mode)()
