"""Kernel launches of one FP8 layer widen, tensor by tensor (as before) and layer at once, on a real-size block.

    OMP_NUM_THREADS=1 .venv/bin/python bench/widen_launches.py [--dim 1536 --ffn 8960 --heads 12]

One Wan2.1-1.3B transformer block (diffusers' ``WanTransformerBlock``, random bf16 weights) hosted
as FP8 (``HostLayer.consolidate``), its FP8 buffer landed in CPU regions, then widened (1) tensor
by tensor with ``quant.widen_fp8`` (the engine's widen until now) and (2) with
``offload_core.fp8_widen.widen_layer``. Launches are the aten ops dispatched that are not views
(``testing.dispatch``): on CPU, where the conversion is a table lookup (two ops per 4 Mi elements);
and for the layer widen on ``meta`` too, which takes CUDA's path (one ``copy_`` per run, the
float32 scales as they are). The per-tensor widen on CUDA also synchronised the host once per
tensor (``torch.equal`` on the scales). Both results are checked bit for bit. CPU seconds are
the best of 3. On ``meta`` (CUDA's ops, no kernels run) it also times the launch thread's host
time per layer widen: with its operand views made at each call (as the ring did) and bound once
per place (``BoundWiden``, as the ring does now); best of 5 rounds of 2,000 calls.

Last line: one JSON object.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from offload_core.fp8_widen import BoundWiden, widen_layer, widen_plan  # noqa: E402
from offload_core.host.tier import HostingTier  # noqa: E402
from offload_core.layout import FP8_HOST_DTYPE, tensor_view  # noqa: E402
from offload_core.quant import WeightFormat, layer_layout, widen_fp8  # noqa: E402
from offload_core.streaming.host_layer import HostLayer, _fp8_views  # noqa: E402
from testing.dispatch import count_launches  # noqa: E402


def per_tensor(host: HostLayer, regions) -> None:
    for at in host.layout.quantized:
        meta = host.layout.tensors[at.index]
        q, scale = _fp8_views(regions[FP8_HOST_DTYPE], meta, at)
        widen_fp8(q, scale, tensor_view(regions[meta.dtype], meta))


def regions_for(host: HostLayer, device: str = "cpu") -> dict:
    regions = {d: torch.zeros(n, dtype=torch.uint8, device=device) for d, n in host.layout.flat_bytes}
    regions[FP8_HOST_DTYPE] = torch.zeros(host.layout.landing_bytes, dtype=torch.uint8, device=device)
    if device == "cpu":
        host.copy_host_bytes(regions)
    return regions


def best_s(fn, repeats: int = 3) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def host_us(fn, calls: int = 2000, rounds: int = 5) -> float:
    """Host microseconds per call of ``fn``: best of ``rounds`` rounds of ``calls``."""
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls)
    return best * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dim", type=int, default=1536)
    parser.add_argument("--ffn", type=int, default=8960)
    parser.add_argument("--heads", type=int, default=12)
    args = parser.parse_args()
    from diffusers.models.transformers.transformer_wan import WanTransformerBlock

    torch.manual_seed(0)
    block = WanTransformerBlock(args.dim, args.ffn, args.heads).to(torch.bfloat16).eval()
    layout = layer_layout("blocks.0", block, WeightFormat.FP8)
    named = dict(block.named_parameters())
    host = HostLayer.consolidate(layout, [named[m.name].data for m in layout.tensors], HostingTier.PAGEABLE,
                                 torch.device("cpu"))
    plan = widen_plan(layout)
    old, new = regions_for(host), regions_for(host)
    old_count = count_launches(lambda: per_tensor(host, old))
    new_count = count_launches(lambda: widen_layer(plan, new))
    equal = all(torch.equal(tensor_view(old[m.dtype], m), tensor_view(new[m.dtype], m)) for m in layout.tensors)
    meta = regions_for(host, "meta")
    meta_count = count_launches(lambda: widen_layer(plan, meta))
    old_s, new_s = best_s(lambda: per_tensor(host, old)), best_s(lambda: widen_layer(plan, new))
    bound = BoundWiden(plan, meta)
    unbound_us, bound_us = host_us(lambda: widen_layer(plan, meta)), host_us(bound)
    n = len(layout.quantized)
    print(f"Wan2.1 block dim {args.dim} ffn {args.ffn}: {n} quantized tensors, {len(layout.tensors)} in all; "
          f"{len(plan.runs)} run(s), {len(plan.groups)} scale groups "
          f"({', '.join(f'{g.count}x{g.rows}x{g.cols}' for g in plan.groups)})")
    print(f"  per tensor : {old_count.launches:4d} launches on CPU {dict(old_count.ops)}; "
          f"on CUDA ~{5 * n} launches + {n} host syncs; {old_s * 1e3:.1f} ms CPU")
    print(f"  layer-wide : {new_count.launches:4d} launches on CPU {dict(new_count.ops)}; "
          f"{meta_count.launches} on CUDA's path (meta) {dict(meta_count.ops)}, no host sync; {new_s * 1e3:.1f} ms CPU")
    print(f"  launch thread per layer widen on CUDA's path (meta): {unbound_us:.1f} us with its views made per "
          f"call, {bound_us:.1f} us bound once per place")
    print(f"  bitwise equal: {equal}")
    print(json.dumps({
        "bench": "widen_launches", "dim": args.dim, "ffn": args.ffn, "quantized_tensors": n,
        "runs": len(plan.runs), "groups": len(plan.groups),
        "per_tensor_launches_cpu": old_count.launches, "per_tensor_launches_cuda_estimate": 5 * n,
        "per_tensor_host_syncs_cuda": n,
        "layer_launches_cpu": new_count.launches, "layer_launches_cuda_path": meta_count.launches,
        "per_tensor_cpu_s": round(old_s, 5), "layer_cpu_s": round(new_s, 5), "bitwise_equal": equal,
        "host_us_views_per_call": round(unbound_us, 1), "host_us_bound_once": round(bound_us, 1),
    }))


if __name__ == "__main__":
    main()
