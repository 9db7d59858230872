"""FP8 widening's cost per layer beside the copy it saves, on one real-size Wan2.1 block with random weights.

The engine's own code (``HostLayer``: quantize at consolidation, ``copy_host_bytes``, ``widen``)
on a block laid out as the engine lays it out: the bf16 layer's copy from its host buffers, the FP8
layer's copy (8-bit values and scales, the kept tensors' bf16 run), and the widen of its
quantized tensors into the slot. On CUDA the host buffers are pinned and each part is timed with
events on the copy stream; on CPU the "copy" is a memcpy into a separate allocation and the widen
runs on the CPU (what a CPU-only replica pays). It also checks the widened slot is bit for bit the
fake-quantized weight, and that quantizing twice gives the same bytes.

    .venv/bin/python bench/widen_cost.py --device cuda       # last line: one JSON object
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from offload_core.buffers import RegionMap  # noqa: E402
from offload_core.fp8_widen import WidenMode, group_operands, widen_layer, widen_plan  # noqa: E402
from offload_core.host.tier import HostingTier  # noqa: E402
from offload_core.layout import FP8_HOST_DTYPE, tensor_view  # noqa: E402
from offload_core.planner.real_models import meta_component  # noqa: E402
from offload_core.quant import (  # noqa: E402
    FP8_DTYPE,
    WeightFormat,
    convert_fp8,
    dequantize_fp8,
    layer_layout,
    quantize_fp8,
)
from offload_core.streaming.device import get_device  # noqa: E402
from offload_core.streaming.host_layer import HostLayer  # noqa: E402


def _block(model: str) -> torch.nn.Module:
    block = meta_component(model, "transformer").blocks[0]
    block = block.to_empty(device="cpu")
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in block.parameters():
            param.copy_(torch.randn(param.shape, generator=generator, dtype=torch.float32).mul_(0.02))
    return block.to(torch.bfloat16)


def _timed(device, work, repeats: int) -> float:
    """Median seconds of ``work()`` run on the copy stream (CUDA events) or on the host (CPU)."""
    context = get_device(device)
    times = []
    for _ in range(repeats + 1):  # the first is the warm-up
        if context.is_cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            with context.on_copy_stream():
                start.record()
                work()
                end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            work()
            times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def _convert_runs(plan, regions) -> None:
    landing = regions[FP8_HOST_DTYPE]
    for run in plan.runs:
        q = landing[run.fp8_start:run.fp8_end].view(FP8_DTYPE)
        convert_fp8(q, regions[run.dtype][run.device_start:run.device_start + q.numel() * run.dtype.itemsize]
                    .view(run.dtype))


def _widen_narrowed(plan, regions) -> None:
    """``fp8_widen.widen_layer`` with each group's scales cast to the compute dtype first (one more
    small kernel per group; exact for power-of-two scales in bf16's range, checked by the caller)."""
    _convert_runs(plan, regions)
    for group in plan.groups:
        out, scales = group_operands(group, regions)
        out.mul_(scales.to(group.dtype).view(group.count, group.rows, 1))


def _check_narrowed(plan, regions, device) -> bool:
    """The narrowed widen writes the engine's bytes."""
    _widen_narrowed(plan, regions)
    narrowed = {dtype: region.clone() for dtype, region in regions.items() if dtype != FP8_HOST_DTYPE}
    widen_layer(plan, regions)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return all(torch.equal(narrowed[dtype], regions[dtype]) for dtype in narrowed)


def measure(model: str, device: torch.device, repeats: int) -> dict:
    block = _block(model)
    params = [p.data for _, p in block.named_parameters()]
    native = layer_layout("blocks.0", block, WeightFormat.NATIVE)
    fp8 = layer_layout("blocks.0", block, WeightFormat.FP8)
    tier = HostingTier.PINNED if device.type == "cuda" else HostingTier.PAGEABLE
    hosts = {w: HostLayer.consolidate(layout, params, tier, device) for w, layout in (("bf16", native), ("fp8", fp8))}
    try:
        regions = RegionMap.covering([fp8])
        slot = torch.empty(regions.nbytes, dtype=torch.uint8, device=device)
        carved = regions.carve(slot)
        carved[FP8_HOST_DTYPE] = torch.empty(fp8.landing_bytes, dtype=torch.uint8, device=device)
        native_slot = RegionMap.covering([native]).carve(torch.empty(native.nbytes, dtype=torch.uint8, device=device))
        bf16_copy = _timed(device, lambda: hosts["bf16"].copy_to(native_slot), repeats)
        fp8_copy = _timed(device, lambda: hosts["fp8"].copy_host_bytes(carved), repeats)
        widen = _timed(device, lambda: hosts["fp8"].widen(carved), repeats)
        plan = widen_plan(fp8)
        # What the next change would buy: the conversion alone, and the multiply in the compute dtype
        # (scales narrowed first: a bf16 x bf16 multiply against the engine's promoted bf16 x fp32).
        convert_only = _timed(device, lambda: _convert_runs(plan, carved), repeats)
        narrowed = _timed(device, lambda: _widen_narrowed(plan, carved), repeats)
        narrowed_exact = _check_narrowed(plan, carved, device)
        # The fused widen (WidenMode.FUSED: one compiled pass per group; compiled in the warm-up call),
        # its bytes against the eager widen's
        fused = _timed(device, lambda: hosts["fp8"].widen(carved, WidenMode.FUSED), repeats)
        fused_out = {dtype: region.clone() for dtype, region in carved.items() if dtype != FP8_HOST_DTYPE}
        hosts["fp8"].widen(carved)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        fused_exact = all(torch.equal(fused_out[dtype], carved[dtype]) for dtype in fused_out)
        exact = True
        for at in fp8.quantized:
            meta = fp8.tensors[at.index]
            want = dequantize_fp8(*quantize_fp8(params[at.index]), meta.dtype)
            exact &= torch.equal(tensor_view(carved[meta.dtype], meta).cpu(), want)
        q1, s1 = quantize_fp8(params[fp8.quantized[0].index])
        q2, s2 = quantize_fp8(params[fp8.quantized[0].index].clone())
        deterministic = torch.equal(q1.view(torch.uint8), q2.view(torch.uint8)) and torch.equal(s1, s2)
    finally:
        for host in hosts.values():
            host.free()
    saved = bf16_copy - fp8_copy
    return {"model": model, "device": str(device), "tier": tier.value, "layer_bf16_bytes": native.nbytes,
            "layer_fp8_host_bytes": fp8.host_nbytes, "quantized_tensors": len(fp8.quantized),
            "quantized_share_of_bytes": round(sum(fp8.tensors[q.index].extent_bytes for q in fp8.quantized)
                                              / native.tensor_bytes, 4),
            "bf16_copy_ms": round(bf16_copy * 1e3, 3), "fp8_copy_ms": round(fp8_copy * 1e3, 3),
            "widen_ms": round(widen * 1e3, 3), "copy_saved_ms": round(saved * 1e3, 3),
            "widen_launches": plan.launches, "convert_only_ms": round(convert_only * 1e3, 3),
            "widen_narrowed_scales_ms": round(narrowed * 1e3, 3), "narrowed_bitwise_equal": narrowed_exact,
            "widen_fused_ms": round(fused * 1e3, 3), "fused_bitwise_equal": fused_exact,
            "widen_over_saved": round(widen / saved, 3) if saved > 0 else None,
            "widened_bitwise_equal_to_reference": bool(exact), "quantize_deterministic": bool(deterministic)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--model", default=None, help="default: wan2.1-t2v-14b on CUDA, wan2.1-t2v-1.3b on CPU")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    device = torch.device(args.device)
    model = args.model or ("wan2.1-t2v-14b" if device.type == "cuda" else "wan2.1-t2v-1.3b")
    result = measure(model, device, args.repeats)
    print(f"{model} block on {device}: bf16 copy {result['bf16_copy_ms']} ms, fp8 copy {result['fp8_copy_ms']} ms "
          f"(saves {result['copy_saved_ms']} ms), widen {result['widen_ms']} ms in {result['widen_launches']} launches "
          f"(conversion alone {result['convert_only_ms']} ms; scales narrowed {result['widen_narrowed_scales_ms']} ms, "
          f"bitwise {result['narrowed_bitwise_equal']}; fused {result['widen_fused_ms']} ms, bitwise "
          f"{result['fused_bitwise_equal']})")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
