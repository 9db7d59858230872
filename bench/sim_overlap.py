"""Copy/compute overlap of the streaming engine on the simulated accelerator (CUDA's rules, virtual clock).

    .venv/bin/python bench/sim_overlap.py --quick

For each hosting tier (pinned, pageable, mapped) x prefetch depth (1, 2) x model (copy-bound,
balanced, compute-bound), streams a small model on :class:`SimDevice` (PCIe Gen4: 25 GB/s pinned,
10 GB/s pageable and mapped, 12 GB/s host memcpy) and prints the simulated steady-state step time
(the last of 3 steps, 4 without --quick: the pipeline is full, the last layer already prefetched
the next step's first) over the bound ``max(sum copy, sum compute) + one layer's copy``.

``sum copy`` is what the tier could achieve at best: for PINNED the DMA at the pinned rate; for
PAGEABLE and MAPPED the copy is a two-stage pipeline (host memcpy into a pinned staging buffer,
then the DMA from it), so each layer counts its slowest stage (``copy_bound_by`` in the JSON says
which). Compute per layer is ``factor x`` that layer's copy stage: 0.5 copy-bound, 1 balanced, 2
compute-bound. Target: every ratio <= 1.05. The negative control streams the balanced pageable
case with staging switched off (the driver's blocking pageable copy); it must show the
serialisation, >= 1.5, or the simulator could not fail. Every run is also checked bitwise against
the plain model and its measured weight peak against the engine's prediction.
Last line: one JSON object with ``max_ratio`` and ``negative_control_ratio``.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from offload_core.host.tier import HostingTier  # noqa: E402
from offload_core.layout import LayerLayout  # noqa: E402
from offload_core.streaming.engine import StreamingConfig, apply_layer_streaming  # noqa: E402
from offload_core.streaming.sim import SimDevice, SimLink  # noqa: E402

MODELS = {"copy-bound": 0.5, "balanced": 1.0, "compute-bound": 2.0}  # compute / copy stage per layer
TIERS = (HostingTier.PINNED, HostingTier.PAGEABLE, HostingTier.MAPPED)
DEPTHS = (1, 2)
STAGING_FIELD = "staged_copies"  # StreamingConfig's switch, once the engine stages copies


class Block(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc(self.norm(x))


class Stack(nn.Module):
    """A denoiser-shaped stack: a non-layer input projection, then ``layers`` streamed blocks."""

    offload_layer_groups = ("blocks",)

    def __init__(self, layers: int, dim: int):
        super().__init__()
        self.proj_in = nn.Linear(dim, dim)
        self.blocks = nn.ModuleList(Block(dim) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.proj_in(x)
        for block in self.blocks:
            x = block(x)
        return x


@dataclass(frozen=True)
class Case:
    tier: HostingTier
    depth: int
    model: str
    staging: bool = True


@dataclass(frozen=True)
class Outcome:
    case: Case
    step_s: float
    bound_s: float
    copy_bound_by: str  # "dma" or "host_memcpy": the slowest stage of the copy pipeline
    bitwise_equal: bool
    peak_predicted: bool
    blocked_s: float  # launch-thread time blocked in driver-staged copies during the step

    @property
    def ratio(self) -> float:
        return self.step_s / self.bound_s


def copy_stage(layout: LayerLayout, tier: HostingTier, link: SimLink) -> tuple[float, str]:
    """Seconds of the slowest stage of the best copy pipeline for one layer, and which stage it is.

    The DMA moves the flat layout (``nbytes``, tensors at aligned offsets); a host memcpy of a
    MAPPED layer reads only the tensors themselves (``tensor_bytes``), a PAGEABLE one its flat buffer.
    """
    dma = layout.nbytes / link.pinned_Bps
    if tier is HostingTier.PINNED:
        return dma, "dma"
    read = layout.tensor_bytes if tier is HostingTier.MAPPED else layout.nbytes
    memcpy = read / link.host_memcpy_Bps
    return (memcpy, "host_memcpy") if memcpy >= dma else (dma, "dma")


def config_for(case: Case, keys: list[str]) -> StreamingConfig:
    extra = {}
    if STAGING_FIELD in {f.name for f in dataclasses.fields(StreamingConfig)}:
        extra[STAGING_FIELD] = case.staging
    # else: this engine has no staging: every pageable/mapped copy is the driver's blocking one
    return StreamingConfig(prefetch_depth=case.depth, hosting={k: case.tier for k in keys}, **extra)


def run_case(case: Case, layers: int, dim: int, steps: int, link: SimLink) -> Outcome:
    torch.manual_seed(0)
    model = Stack(layers, dim).eval()
    x = torch.randn(4, dim, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = model(x)
    device = SimDevice(link)
    keys = [f"blocks.{i}" for i in range(layers)]
    streamer = apply_layer_streaming(model, device, config_for(case, keys))
    device.register_streamer(streamer)
    stages = {layer.key: copy_stage(layer.layout, case.tier, link) for layer in streamer.layers}
    compute = {key: MODELS[case.model] * seconds for key, (seconds, _) in stages.items()}
    device.charge_layer_compute(streamer, compute)
    streamer.prepare_for_use()
    ends, equal = [], True
    blocked_before = 0.0
    with torch.no_grad():
        for _ in range(steps):
            blocked_before = device.blocked_s
            out = model(x)
            device.synchronize()
            ends.append(device.now)
            equal = equal and torch.equal(out, expected)
    peak_ok = streamer.meter.peak_bytes == streamer.predicted_peak_bytes()
    streamer.remove()
    sum_copy = sum(seconds for seconds, _ in stages.values())
    bound = max(sum_copy, sum(compute.values())) + max(seconds for seconds, _ in stages.values())
    by = sorted({stage for _, stage in stages.values()})
    return Outcome(case, ends[-1] - ends[-2], bound, "+".join(by), equal, peak_ok,
                   device.blocked_s - blocked_before)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="8 layers of 128 (default 24 of 256)")
    parser.add_argument("--pinned-GBps", type=float, default=25.0)
    parser.add_argument("--pageable-GBps", type=float, default=10.0)
    parser.add_argument("--host-memcpy-GBps", type=float, default=12.0)
    args = parser.parse_args()
    layers, dim, steps = (8, 128, 3) if args.quick else (24, 256, 4)
    link = SimLink(pinned_Bps=args.pinned_GBps * 1e9, pageable_Bps=args.pageable_GBps * 1e9,
                   mapped_Bps=args.pageable_GBps * 1e9, host_memcpy_Bps=args.host_memcpy_GBps * 1e9)
    staging = STAGING_FIELD in {f.name for f in dataclasses.fields(StreamingConfig)}
    print(f"simulated link: {link}; {layers} layers of {dim}x{dim}; engine stages copies: {staging}")
    print(f"{'tier':9} {'depth':>5} {'model':14} {'step us':>9} {'bound us':>9} {'ratio':>6} "
          f"{'copy bound by':14} {'blocked us':>10} bitwise peak=pred")
    outcomes = []
    for tier in TIERS:
        for depth in DEPTHS:
            for model in MODELS:
                o = run_case(Case(tier, depth, model), layers, dim, steps, link)
                outcomes.append(o)
                print(f"{tier.value:9} {depth:>5} {model:14} {o.step_s * 1e6:>9.3f} {o.bound_s * 1e6:>9.3f} "
                      f"{o.ratio:>6.3f} {o.copy_bound_by:14} {o.blocked_s * 1e6:>10.3f} "
                      f"{o.bitwise_equal!s:7} {o.peak_predicted}", flush=True)
    control = run_case(Case(HostingTier.PAGEABLE, 1, "balanced", staging=False), layers, dim, steps, link)
    print(f"negative control (balanced, pageable, depth 1, staging off): ratio {control.ratio:.3f}")
    print(json.dumps({
        "bench": "sim_overlap", "quick": args.quick, "engine_stages_copies": staging,
        "link": dataclasses.asdict(link), "layers": layers,
        "cases": [{"tier": o.case.tier.value, "depth": o.case.depth, "model": o.case.model,
                   "step_s": o.step_s, "bound_s": o.bound_s, "ratio": round(o.ratio, 4),
                   "copy_bound_by": o.copy_bound_by, "blocked_s": o.blocked_s,
                   "bitwise_equal": o.bitwise_equal, "peak_equals_prediction": o.peak_predicted}
                  for o in outcomes],
        "max_ratio": round(max(o.ratio for o in outcomes), 4),
        "negative_control_ratio": round(control.ratio, 4),
        "all_bitwise_equal": all(o.bitwise_equal for o in [*outcomes, control]),
        "all_peaks_predicted": all(o.peak_predicted for o in [*outcomes, control]),
    }))


if __name__ == "__main__":
    main()
