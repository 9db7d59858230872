"""The H200 runs of 2026-12-04 as simulator inputs, and the cases that replay them (``bench/sim_overlap.py``).

A real-size Wan2.1-1.3B transformer (30 blocks, 2.79 GB streamed per step) on one H200, run by
``bench/gpu_check.sh --require-cuda`` (``OMP_NUM_THREADS=1``) and through the public API; the figures
below are those runs' (the copy rates, the step times) or derived from them (how the launch thread's
time splits), each said where it comes from. A case streams 30 bf16 blocks on the simulated
accelerator with every rate scaled by (the stand-in block's bytes / a real block's bytes), so its
step time is in the real model's seconds while the data stays small and exact.

Tests and benches only.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from offload_core.host.tier import HostingTier
from offload_core.quant import WeightFormat, fake_quantize_
from offload_core.streaming.engine import StreamingConfig, apply_layer_streaming
from testing.sim import SimDevice
from testing.sim_link import SimLink

LAYERS = 30
LAYER_BYTES = 2.79e9 / LAYERS  # a Wan2.1-1.3B block in bf16, as streamed
PINNED_BPS = 55.3e9  # link.py on the H200
PAGEABLE_BPS = 8.1e9
STAGED_1T_BPS = 5.4e9  # link.py's staged rate: one memcpy thread under OMP_NUM_THREADS=1
# memcpy.json, pageable -> pinned split over Python threads with one intra-op thread each:
# 5.2 / 10.1 / 18.5 / 28.3 GB/s at 1 / 2 / 4 / 8; n x 4.7 up to 28.3 fits 2-8 within 7 %.
MEMCPY_PER_THREAD_BPS = 4.7e9
MEMCPY_MAX_BPS = 28.3e9
COPY_LATENCY_S = 10e-6
# The launch thread: the resident step at 1 frame, 41.8 ms for 30 blocks, is launch-bound (the
# profile's device time is a fraction of it): 1.39 ms of launches per block, taken as 40 kernels of
# 34.8 us (the per-kernel figure is what matters: the widen's launches pay the same).
KERNELS_PER_LAYER = 40
LAUNCH_S = 0.0418 / LAYERS / KERNELS_PER_LAYER
HOOK_S = 165e-6  # bench/hook_cost.py --device cuda: the engine's hooks per layer
# Device compute per block: at 6 frames the resident step / 30 (107.9 ms, compute-bound); at 1
# frame the profile's kernels, ~12 ms per step (launch-bound: they hide under the launches).
COMPUTE_S = {6: 0.1079 / LAYERS, 1: 0.012 / LAYERS}
# A Wan2.1-14B block's widen on the H200: 2.406 ms for its 0.704 GB of bf16 (12.734 ms at 55.3 GB/s).
WIDEN_BPS = 0.704e9 / 2.406e-3
# Launches per layer of the widen: tensor by tensor (5 per quantized tensor, and one host read of
# the scales each) against one conversion per run and one multiply per group (bench/widen_launches.py
# on a real-size block: 10 quantized tensors, 1 run, 3 groups).
PER_TENSOR_WIDEN = (50, 10)
LAYER_WIDEN = (4, 0)

# What the device measured for a case, seconds (None: not run on the device yet).
DEVICE_STEP_S = {
    "pinned 6 frames": 0.1108,  # gpu_check.log
    "pageable staged 1 copier thread at 5.4 GB/s 6 frames (528c2f0)": 0.5548,
    "pageable unstaged 6 frames": 0.4597,
    "pinned 1 frame": 0.0544,  # the stable run (another gave 77.2 ms)
    "fp8 per-tensor widen 1 frame (528c2f0)": 0.1228,  # truth.log, 1.59x its run's bf16 pinned step
}


class Block(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc(self.norm(x))


class Stack(nn.Module):
    offload_layer_groups = ("blocks",)

    def __init__(self, dim: int):
        super().__init__()
        self.blocks = nn.ModuleList(Block(dim) for _ in range(LAYERS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


@dataclass(frozen=True)
class H200Case:
    name: str
    tier: HostingTier
    frames: int
    copier_threads: int = 1
    staged: bool = True
    weights: WeightFormat = WeightFormat.NATIVE
    widen: tuple[int, int] = LAYER_WIDEN  # (launches, host syncs) per FP8 layer
    memcpy_Bps: float = MEMCPY_PER_THREAD_BPS  # one copier thread's

    @property
    def device_step_s(self) -> float | None:
        return DEVICE_STEP_S.get(self.name)


def cases() -> list[H200Case]:
    """The old engine's failures (528c2f0: the negative controls), the device's other figures, and the fixed engine."""
    old_fp8 = dict(weights=WeightFormat.FP8, widen=PER_TENSOR_WIDEN)
    return [
        H200Case("pinned 6 frames", HostingTier.PINNED, 6),
        H200Case("pageable staged 1 copier thread at 5.4 GB/s 6 frames (528c2f0)", HostingTier.PAGEABLE, 6,
                 memcpy_Bps=STAGED_1T_BPS),
        H200Case("pageable unstaged 6 frames", HostingTier.PAGEABLE, 6, staged=False),
        H200Case("pageable staged 4 copier threads 6 frames", HostingTier.PAGEABLE, 6, copier_threads=4),
        H200Case("pageable staged 8 copier threads 6 frames", HostingTier.PAGEABLE, 6, copier_threads=8),
        H200Case("mapped staged 8 copier threads 6 frames", HostingTier.MAPPED, 6, copier_threads=8),
        H200Case("pinned 1 frame", HostingTier.PINNED, 1),
        H200Case("fp8 per-tensor widen 1 frame (528c2f0)", HostingTier.PINNED, 1, **old_fp8),
        H200Case("fp8 layer widen 1 frame", HostingTier.PINNED, 1, weights=WeightFormat.FP8),
        H200Case("fp8 layer widen 6 frames", HostingTier.PINNED, 6, weights=WeightFormat.FP8),
    ]


def link_for(case: H200Case, scale: float) -> SimLink:
    """The H200's rates times ``scale`` (stand-in bytes per real byte); host costs in real seconds."""
    return SimLink(pinned_Bps=PINNED_BPS * scale, pageable_Bps=PAGEABLE_BPS * scale,
                   mapped_Bps=PAGEABLE_BPS * scale, host_memcpy_Bps=case.memcpy_Bps * scale,
                   host_memcpy_max_Bps=MEMCPY_MAX_BPS * scale, launch_s=LAUNCH_S,
                   copy_latency_s=COPY_LATENCY_S, widen_Bps=WIDEN_BPS * scale)


@dataclass(frozen=True)
class H200Outcome:
    case: H200Case
    step_s: float
    bitwise_equal: bool
    blocked_s: float

    def as_json(self) -> dict:
        device = self.case.device_step_s
        return {"name": f"h200 {self.case.name}", "shape": "h200", "tier": self.case.tier.value,
                "frames": self.case.frames, "copier_threads": self.case.copier_threads,
                "staged": self.case.staged, "weights": self.case.weights.value,
                "step_s": round(self.step_s, 5), "device_step_s": device,
                "sim_over_device": None if device is None else round(self.step_s / device, 3),
                "bitwise_equal": self.bitwise_equal, "blocked_s": round(self.blocked_s, 5)}


def run(case: H200Case, dim: int = 64, steps: int = 3) -> H200Outcome:
    """Stream the stand-in stack under ``case`` for ``steps`` steps; the last step's time."""
    torch.manual_seed(0)
    model = Stack(dim).to(torch.bfloat16).eval()
    x = torch.randn(4, dim, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    reference = Stack(dim).to(torch.bfloat16).eval()
    reference.load_state_dict(model.state_dict())
    if case.weights is WeightFormat.FP8:
        fake_quantize_(reference.blocks)
    with torch.no_grad():
        expected = reference(x)
    native_bytes = sum(p.numel() * p.element_size() for p in model.blocks[0].parameters())
    device = SimDevice(link_for(case, native_bytes / LAYER_BYTES))
    keys = [f"blocks.{i}" for i in range(LAYERS)]
    streamer = apply_layer_streaming(model, device, StreamingConfig(
        hosting={k: case.tier for k in keys}, staged_copies=case.staged, weights=case.weights,
        copier_threads=case.copier_threads))
    device.register_streamer(streamer)
    device.charge_layer_compute(streamer, {k: COMPUTE_S[case.frames] for k in keys}, kernels=KERNELS_PER_LAYER,
                                host_s=HOOK_S)
    if case.weights is WeightFormat.FP8:
        device.charge_widen(streamer, *case.widen)
    streamer.prepare_for_use()
    ends, equal = [0.0], True
    with torch.no_grad():
        for _ in range(steps):
            blocked = device.blocked_s
            out = model(x)
            device.synchronize()
            ends.append(device.now)
            equal = equal and torch.equal(out, expected)
    streamer.remove()
    return H200Outcome(case, ends[-1] - ends[-2], equal, device.blocked_s - blocked)


def run_all(dim: int = 64, steps: int = 3) -> list[H200Outcome]:
    return [run(case, dim, steps) for case in cases()]


def summary(outcomes: list[H200Outcome]) -> dict:
    """The ratios the issue's targets and negative controls are stated in."""
    step = {o.case.name: o.step_s for o in outcomes}
    pinned6, pinned1 = step["pinned 6 frames"], step["pinned 1 frame"]
    return {
        "old_staged_over_pinned": round(step["pageable staged 1 copier thread at 5.4 GB/s 6 frames (528c2f0)"]
                                        / pinned6, 3),
        "old_fp8_over_bf16_1frame": round(step["fp8 per-tensor widen 1 frame (528c2f0)"] / pinned1, 3),
        "staged_4_threads_over_pinned": round(step["pageable staged 4 copier threads 6 frames"] / pinned6, 3),
        "staged_8_threads_over_pinned": round(step["pageable staged 8 copier threads 6 frames"] / pinned6, 3),
        "mapped_8_threads_over_pinned": round(step["mapped staged 8 copier threads 6 frames"] / pinned6, 3),
        "unstaged_over_staged_8_threads": round(step["pageable unstaged 6 frames"]
                                                / step["pageable staged 8 copier threads 6 frames"], 3),
        "fp8_over_bf16_1frame": round(step["fp8 layer widen 1 frame"] / pinned1, 3),
        "fp8_over_bf16_6frames": round(step["fp8 layer widen 6 frames"] / pinned6, 3),
        "pinned_over_bound_1frame": round(pinned1 / max(0.0418, LAYERS * LAYER_BYTES / PINNED_BPS), 3),
    }


__all__ = ["DEVICE_STEP_S", "H200Case", "H200Outcome", "cases", "run", "run_all", "summary"]
