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

import dataclasses
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
STAGED_1T_BPS = 5.4e9  # link.py's staged rate: one memcpy thread under OMP_NUM_THREADS=1
# memcpy.json, pageable -> pinned split over Python threads with one intra-op thread each:
# 5.2 / 10.1 / 18.5 / 28.3 GB/s at 1 / 2 / 4 / 8; n x 4.7 up to 28.3 fits 2-8 within 7 %.
MEMCPY_PER_THREAD_BPS = 4.7e9
MEMCPY_MAX_BPS = 28.3e9
COPY_LATENCY_S = 10e-6
# The launch thread: the resident step at 1 frame is launch-bound (the profile's device time is a
# fraction of it), taken as 40 kernels per block (the per-kernel figure is what matters: the widen's
# launches pay the same), each run's resident 1-frame step / 30 / 40.
KERNELS_PER_LAYER = 40
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
# The fused widen (WidenMode.FUSED): one compiled pass per group, 3 kernels for a real-size block,
# moving 3 B per element where the eager widen moves 7 (taken as 7/3 of its rate: bandwidth-bound;
# projected, not measured; the compiled call's own host time is not modelled).
FUSED_WIDEN = (3, 0)
FUSED_WIDEN_SPEEDUP = 7 / 3
# The stand-in block's width. A real block's weights are 99.97 % quantizable Linear bytes; at 64 the
# stand-in's LayerNorm, bias and alignment padding made its FP8 copy 0.75 of its bf16 one (real:
# 0.50), so the FP8 cases were copy-bound where the device's are not; 256 puts every case within
# 1 % of 512's (1.6 s for all cases here).
STAND_IN_DIM = 256


@dataclass(frozen=True)
class DeviceRun:
    """What one H200 run measured that the simulator takes as input (each its run's own figure)."""

    commit: str
    pinned_Bps: float  # link.py
    pageable_Bps: float
    resident_1frame_s: float  # the resident step at 1 frame: the launch thread's time per step
    hook_s: float  # bench/hook_cost.py --device cuda: the engine's hooks per layer

    @property
    def launch_s(self) -> float:
        return self.resident_1frame_s / LAYERS / KERNELS_PER_LAYER


# 528c2f0: the engine the issue was filed against (gpu_check.log, truth.log, memcpy.json).
OLD = DeviceRun("528c2f0", pinned_Bps=55.3e9, pageable_Bps=8.1e9, resident_1frame_s=0.0418, hook_s=165e-6)
# 4ed5bc7: split fills (7 copier threads, the probe's choice), the layer-wide widen, lighter hooks
# (bench/results/gpu_check-h200-2026-12-04.json, run 2; medians of its steps).
FIXED = DeviceRun("4ed5bc7", pinned_Bps=54.25e9, pageable_Bps=8.68e9, resident_1frame_s=0.0348, hook_s=105.6e-6)
# Not a run: 4ed5bc7 with its blocks compiled (``compile: blocks``), a projection. On the 528c2f0
# H200, diffusers' compile_repeated_blocks took the resident 1-frame step from 47.1 to 20.2 ms
# (0.43x; docs/benchmarks.md, "torch.compile of the repeated blocks"); 4ed5bc7's 34.8 ms x 0.43.
COMPILED = dataclasses.replace(FIXED, commit="4ed5bc7, blocks compiled (projection)",
                               resident_1frame_s=FIXED.resident_1frame_s * 0.0202 / 0.0471)

# What the device measured for a case, seconds (None: not run on the device yet).
DEVICE_STEP_S = {
    "pinned 6 frames": 0.1108,  # gpu_check.log
    "pageable staged 1 copier thread at 5.4 GB/s 6 frames (528c2f0)": 0.5548,
    "pageable unstaged 6 frames": 0.4597,
    "pinned 1 frame": 0.0544,  # the stable run (another gave 77.2 ms)
    "fp8 per-tensor widen 1 frame (528c2f0)": 0.1228,  # truth.log, 1.59x its run's bf16 pinned step
    "pinned 6 frames (4ed5bc7)": 0.1110,
    "pageable staged 7 copier threads 6 frames (4ed5bc7)": 0.1133,
    "pageable unstaged 6 frames (4ed5bc7)": 0.4327,
    "mapped staged 7 copier threads 6 frames (4ed5bc7)": 0.1437,
    "pinned 1 frame (4ed5bc7)": 0.0551,
    "fp8 layer widen 1 frame (4ed5bc7)": 0.0486,
    "fp8 layer widen 6 frames (4ed5bc7)": 0.1236,
}
# Cases whose device figure depends on a rate the simulator has not been given. Mapped: the copier
# reads a page-cached file mapping, modelled at the anonymous pageable memcpy rate; on the H200 the
# mapped step (143.7 ms) ran 1.27x the pageable one (113.3 ms) through the same staging, and no run
# has measured a memcpy out of a file mapping yet (bench/staged_sweep.py does, from the next run).
UNMODELLED = {"mapped staged 7 copier threads 6 frames (4ed5bc7)":
              "no memcpy rate out of a file mapping measured (the simulator copies it at the pageable rate)"}


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
    widen_speedup: float = 1.0  # the widen's rate over the eager widen's measured WIDEN_BPS
    memcpy_Bps: float = MEMCPY_PER_THREAD_BPS  # one copier thread's
    run: DeviceRun = OLD  # whose rates and launch-thread costs

    @property
    def device_step_s(self) -> float | None:
        return DEVICE_STEP_S.get(self.name)


def cases() -> list[H200Case]:
    """The old engine's failures (528c2f0: the negative controls), the device's other figures, and the
    fixed engine as 4ed5bc7 ran it (its own rates and launch-thread costs) and as eight threads would."""
    old_fp8 = dict(weights=WeightFormat.FP8, widen=PER_TENSOR_WIDEN)
    fp8, fixed = WeightFormat.FP8, dict(run=FIXED)
    fused = dict(widen=FUSED_WIDEN, widen_speedup=FUSED_WIDEN_SPEEDUP)
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
        H200Case("fp8 layer widen 1 frame", HostingTier.PINNED, 1, weights=fp8),
        H200Case("fp8 layer widen 6 frames", HostingTier.PINNED, 6, weights=fp8),
        H200Case("pinned 6 frames (4ed5bc7)", HostingTier.PINNED, 6, **fixed),
        H200Case("pageable staged 7 copier threads 6 frames (4ed5bc7)", HostingTier.PAGEABLE, 6, copier_threads=7,
                 **fixed),
        H200Case("pageable unstaged 6 frames (4ed5bc7)", HostingTier.PAGEABLE, 6, staged=False, **fixed),
        H200Case("mapped staged 7 copier threads 6 frames (4ed5bc7)", HostingTier.MAPPED, 6, copier_threads=7,
                 **fixed),
        H200Case("pinned 1 frame (4ed5bc7)", HostingTier.PINNED, 1, **fixed),
        H200Case("fp8 layer widen 1 frame (4ed5bc7)", HostingTier.PINNED, 1, weights=fp8, **fixed),
        H200Case("fp8 layer widen 6 frames (4ed5bc7)", HostingTier.PINNED, 6, weights=fp8, **fixed),
        H200Case("pinned 1 frame, blocks compiled (projection)", HostingTier.PINNED, 1, run=COMPILED),
        H200Case("fp8 layer widen 1 frame, blocks compiled (projection)", HostingTier.PINNED, 1, weights=fp8,
                 run=COMPILED),
        H200Case("fp8 fused widen 6 frames (projection)", HostingTier.PINNED, 6, weights=fp8, **fused, **fixed),
        H200Case("fp8 fused widen 1 frame, blocks compiled (projection)", HostingTier.PINNED, 1, weights=fp8,
                 **fused, run=COMPILED),
    ]


def link_for(case: H200Case, scale: float) -> SimLink:
    """The H200's rates times ``scale`` (stand-in bytes per real byte); host costs in real seconds."""
    run = case.run
    return SimLink(pinned_Bps=run.pinned_Bps * scale, pageable_Bps=run.pageable_Bps * scale,
                   mapped_Bps=run.pageable_Bps * scale, host_memcpy_Bps=case.memcpy_Bps * scale,
                   host_memcpy_max_Bps=MEMCPY_MAX_BPS * scale, launch_s=run.launch_s,
                   copy_latency_s=COPY_LATENCY_S, widen_Bps=WIDEN_BPS * case.widen_speedup * scale)


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
                "unmodelled": UNMODELLED.get(self.case.name),
                "bitwise_equal": self.bitwise_equal, "blocked_s": round(self.blocked_s, 5)}


def run(case: H200Case, dim: int = STAND_IN_DIM, steps: int = 3) -> H200Outcome:
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
                                host_s=case.run.hook_s)
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


def run_all(dim: int = STAND_IN_DIM, steps: int = 3) -> list[H200Outcome]:
    return [run(case, dim, steps) for case in cases()]


def _over_bound_1frame(step_s: float, run: DeviceRun) -> float:
    return round(step_s / max(run.resident_1frame_s, LAYERS * LAYER_BYTES / run.pinned_Bps), 3)


# The ratios the summary reports: (key, case over case).
RATIOS = (
    ("old_staged_over_pinned", "pageable staged 1 copier thread at 5.4 GB/s 6 frames (528c2f0)", "pinned 6 frames"),
    ("old_fp8_over_bf16_1frame", "fp8 per-tensor widen 1 frame (528c2f0)", "pinned 1 frame"),
    ("staged_4_threads_over_pinned", "pageable staged 4 copier threads 6 frames", "pinned 6 frames"),
    ("staged_8_threads_over_pinned", "pageable staged 8 copier threads 6 frames", "pinned 6 frames"),
    ("mapped_8_threads_over_pinned", "mapped staged 8 copier threads 6 frames", "pinned 6 frames"),
    ("unstaged_over_staged_8_threads", "pageable unstaged 6 frames", "pageable staged 8 copier threads 6 frames"),
    ("fp8_over_bf16_1frame", "fp8 layer widen 1 frame", "pinned 1 frame"),
    ("fp8_over_bf16_6frames", "fp8 layer widen 6 frames", "pinned 6 frames"),
    ("fixed_staged_over_pinned", "pageable staged 7 copier threads 6 frames (4ed5bc7)", "pinned 6 frames (4ed5bc7)"),
    ("fixed_mapped_over_pinned", "mapped staged 7 copier threads 6 frames (4ed5bc7)", "pinned 6 frames (4ed5bc7)"),
    ("fixed_unstaged_over_staged", "pageable unstaged 6 frames (4ed5bc7)",
     "pageable staged 7 copier threads 6 frames (4ed5bc7)"),
    ("fixed_fp8_over_bf16_1frame", "fp8 layer widen 1 frame (4ed5bc7)", "pinned 1 frame (4ed5bc7)"),
    ("fixed_fp8_over_bf16_6frames", "fp8 layer widen 6 frames (4ed5bc7)", "pinned 6 frames (4ed5bc7)"),
    # where the launches no longer bind, the copy stream's DMAs do (the widen on its own stream)
    ("compiled_fp8_over_bf16_1frame", "fp8 layer widen 1 frame, blocks compiled (projection)",
     "pinned 1 frame, blocks compiled (projection)"),
    # the fused widen: 3 B per element for the eager widen's 7, so less SM time taken from compute
    ("fused_fp8_over_bf16_6frames", "fp8 fused widen 6 frames (projection)", "pinned 6 frames (4ed5bc7)"),
    ("fused_compiled_fp8_over_bf16_1frame", "fp8 fused widen 1 frame, blocks compiled (projection)",
     "pinned 1 frame, blocks compiled (projection)"),
)


def summary(outcomes: list[H200Outcome]) -> dict:
    """The ratios the issue's targets and negative controls are stated in; ``fixed_*``: 4ed5bc7's costs."""
    step = {o.case.name: o.step_s for o in outcomes}
    found = {key: round(step[a] / step[b], 3) for key, a, b in RATIOS}
    found["pinned_over_bound_1frame"] = _over_bound_1frame(step["pinned 1 frame"], OLD)
    found["fixed_pinned_over_bound_1frame"] = _over_bound_1frame(step["pinned 1 frame (4ed5bc7)"], FIXED)
    return found


__all__ = ["COMPILED", "DEVICE_STEP_S", "FIXED", "OLD", "UNMODELLED", "DeviceRun", "H200Case", "H200Outcome", "cases", "run", "run_all", "summary"]
