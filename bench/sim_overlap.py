"""Copy/compute overlap of the streaming engine on the simulated accelerator (CUDA's rules, virtual clock).

    .venv/bin/python bench/sim_overlap.py --quick

For each hosting tier (pinned, pageable, mapped) x prefetch depth (1, 2) x model (copy-bound,
balanced, compute-bound), streams a stack of even layers on :class:`SimDevice` (PCIe Gen4: 25 GB/s
pinned, 10 GB/s pageable and mapped, 12 GB/s host memcpy), then the named cases: ``uneven``
(FLUX-like: the first third of the layers twice the bytes of the rest, balanced, every tier, at
the depth the planner picks for it, ``offload_core.planner.window.choose_window``, the rule its
search sizes windows by, and the staging ring ``offload_core.planner.staging_ring.choose_staging``
picks at that depth; with ``--uneven-uniform-compute`` every layer computes alike while the
bytes differ, so the window must bank the double blocks' copy deficit ahead) and ``slow-copier`` (pageable, balanced: the copier at half speed for a quarter of the
measured step). Every case also pays what a GPU charges besides bandwidth, scaled to the mean
layer's pinned DMA time ``t`` (a Wan2.1-1.3B block: 58 MB, t = 2.3 ms): ``copy_latency`` 0.5 % t
per copy (~10 us), ``launch`` 2 % t per layer (~46 us: ~10 kernels), and the copier's memcpy
jitters by +-20 % (seeded, zero-mean).

Prints the steady-state step time (the last of 3 steps, 4 without --quick) over the bound
``max(sum copy, sum compute) + the largest layer's copy``; --quick runs 40 layers, so one layer is
2.5 % of the step (under 3 %: the +1 layer term cannot hide a regression). ``sum copy`` is what
the tier could achieve at best: PINNED the DMA; PAGEABLE and MAPPED a two-stage pipeline (host
memcpy into a pinned staging buffer, then the DMA), each layer counting its slowest stage
(``copy_bound_by``); the slow-copier case adds what the stretch takes from the copier (a quarter
step at half speed: an eighth of a step). Compute per layer is ``factor x`` that layer's copy
stage: 0.5 copy-bound, 1 balanced, 2 compute-bound. Target: every ratio <= 1.05. The negative
control streams the balanced pageable case with staging off (the driver's blocking copy); it must
show the serialisation, >= 1.5. Every run is checked bitwise against the plain model and its
weight peak against the engine's prediction. ``blocked_s``: the launch thread's time blocked in
host-blocking copies and waiting for the copier during the step.
Then the ``h200 …`` cases (``testing.h200``): real-size Wan2.1-1.3B on the H200's measured rates
and host costs (a memcpy rate per copier thread, a launch cost per kernel, a launch-bound compute
at 1 latent frame, the engine's hooks, the FP8 widen's launches and host reads): two negative
controls that reproduce 528c2f0's failures (one copier thread at 5.4 GB/s: staged >= 3x pinned;
the per-tensor widen at 1 frame: FP8 slower than bf16), the device's other figures, and the fixed
engine (fills split over copier threads, the layer-wide widen), each step beside the device's
where one was measured (``sim_over_device``).
Last line: one JSON object with ``max_ratio``, ``negative_control_ratio``, ``cases``, ``h200_cases``
and ``h200_summary``.
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

from offload_core.buffers import DEFAULT_STAGING_BUFFERS
from offload_core.host.tier import HostingTier  # noqa: E402
from offload_core.layout import LayerLayout
from offload_core.planner.facts import LinkFacts, profile_component  # noqa: E402
from offload_core.planner.staging_ring import choose_staging  # noqa: E402
from offload_core.planner.window import choose_window  # noqa: E402
from offload_core.streaming.engine import StreamingConfig, apply_layer_streaming  # noqa: E402
from testing import h200  # noqa: E402
from testing.sim import SimDevice, SimLink, SlowStretch  # noqa: E402

MODELS = {"copy-bound": 0.5, "balanced": 1.0, "compute-bound": 2.0}  # compute / copy stage per layer
TIERS = (HostingTier.PINNED, HostingTier.PAGEABLE, HostingTier.MAPPED)
DEPTHS = (1, 2)
# Overheads as fractions of the mean layer's pinned DMA time t (a Wan2.1-1.3B block: t = 2.3 ms).
COPY_LATENCY_T = 0.005  # ~10 us per cudaMemcpyAsync
LAUNCH_T = 0.02  # ~46 us of host time per layer: ~10 kernel launches at ~5 us
JITTER = 0.2  # the copier's memcpy: page faults, the GIL, a shared memory bus
SLOW = (0.25, 0.25, 0.5)  # slow-copier case: from a quarter of the step, for a quarter, at half speed


class Block(nn.Module):
    def __init__(self, dim: int, linears: int = 1):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fcs = nn.ModuleList(nn.Linear(dim, dim) for _ in range(linears))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        for fc in self.fcs:
            h = fc(h)
        return x + h


class Stack(nn.Module):
    """A denoiser-shaped stack: a non-layer input projection, then ``layers`` streamed blocks.

    ``uneven``: the first third are "double" blocks of twice the bytes (FLUX's double then single)."""

    offload_layer_groups = ("blocks",)

    def __init__(self, layers: int, dim: int, uneven: bool = False):
        super().__init__()
        self.proj_in = nn.Linear(dim, dim)
        self.blocks = nn.ModuleList(Block(dim, 2 if uneven and i < layers // 3 else 1) for i in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.proj_in(x)
        for block in self.blocks:
            x = block(x)
        return x


@dataclass(frozen=True)
class Case:
    tier: HostingTier
    depth: int | None  # None: the planner's window for the stack (choose_window)
    model: str
    staging: bool = True
    shape: str = "even"  # "even", "uneven" (FLUX-like) or "slow-copier"
    uniform_compute: bool = False  # uneven: every layer computes the mean copy stage (bytes differ, compute not)

    @property
    def name(self) -> str:
        prefix = "" if self.shape == "even" else f"{self.shape} "
        return f"{prefix}{self.tier.value} depth {self.depth or 'planned'} {self.model}"


@dataclass(frozen=True)
class CaseResult:
    case: Case
    depth: int  # the depth run (the planner's, for a planned case)
    step_s: float
    bound_s: float
    copy_bound_by: str  # "dma" or "host_memcpy": the slowest stage of the copy pipeline
    bitwise_equal: bool
    peak_predicted: bool
    blocked_s: float  # launch-thread time blocked (host-blocking copies, waits for the copier) in the step
    copier_wait_s: float
    staging_buffers: int = DEFAULT_STAGING_BUFFERS  # the ring run (the planner's, for a planned case)

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


def config_for(case: Case, keys: list[str], depth: int, staging_buffers: int) -> StreamingConfig:
    return StreamingConfig(prefetch_depth=depth, hosting={k: case.tier for k in keys}, staged_copies=case.staging,
                           staging_buffers=staging_buffers)


def planned(model: nn.Module, tier: HostingTier, link: SimLink, compute: dict[str, float]) -> tuple[int, int]:
    """The planner's window and staging ring for the stack: its facts read from the model, the simulated
    link's rates (``choose_window``, then ``choose_staging`` at that depth, as the search sizes them)."""
    profile = profile_component("stack", model, uses_per_request=1)
    facts = LinkFacts(pinned_Bps=link.pinned_Bps, pageable_Bps=link.pageable_Bps, staged_Bps=link.host_memcpy_Bps)
    tiers = {layer.key: tier for layer in profile.layers}
    compute_s = [compute[layer.key] for layer in profile.layers]
    depth = choose_window(profile.layers, tiers, facts, compute_s).depth
    staging = choose_staging(profile.layers, tiers, facts, compute_s, depth)
    return depth, staging.buffers if staging is not None else DEFAULT_STAGING_BUFFERS


def with_overheads(link: SimLink, model: nn.Module, streamer) -> SimLink:
    mean_dma = sum(layer.layout.nbytes for layer in streamer.layers) / len(streamer.layers) / link.pinned_Bps
    return dataclasses.replace(link, copy_latency_s=COPY_LATENCY_T * mean_dma, launch_s=LAUNCH_T * mean_dma,
                               copier_jitter=JITTER, seed=0)


def run_case(case: Case, layers: int, dim: int, steps: int, base: SimLink) -> CaseResult:
    torch.manual_seed(0)
    model = Stack(layers, dim, uneven=case.shape == "uneven").eval()
    x = torch.randn(4, dim, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = model(x)
    device = SimDevice(base)
    keys = [f"blocks.{i}" for i in range(layers)]
    layouts = {layer.key: layer.layout for layer in profile_component("stack", model, uses_per_request=1).layers}
    stages = {key: copy_stage(layout, case.tier, base) for key, layout in layouts.items()}
    compute = {key: MODELS[case.model] * seconds for key, (seconds, _) in stages.items()}
    if case.uniform_compute:
        mean = sum(seconds for seconds, _ in stages.values()) / len(stages)
        compute = {key: MODELS[case.model] * mean for key in stages}
    depth, buffers = (case.depth, DEFAULT_STAGING_BUFFERS) if case.depth else planned(model, case.tier, base, compute)
    streamer = apply_layer_streaming(model, device, config_for(case, keys, depth, buffers))
    link = device.link = with_overheads(base, model, streamer)
    device.register_streamer(streamer)
    device.charge_layer_compute(streamer, compute)
    sum_copy = sum(seconds for seconds, _ in stages.values())
    ideal = max(sum_copy, sum(compute.values()))
    streamer.prepare_for_use()
    ends, equal, blocked, waited = [0.0], True, 0.0, 0.0
    with torch.no_grad():
        for step in range(steps):
            if case.shape == "slow-copier" and step == steps - 1:
                start, length, factor = SLOW
                device.link = dataclasses.replace(link, copier_slow=SlowStretch(
                    ends[-1] + start * ideal, ends[-1] + (start + length) * ideal, factor))
                sum_copy += length * ideal * (1 - factor)  # the copier's work the stretch takes
            blocked, waited = device.blocked_s, device.copier_wait_s
            out = model(x)
            device.synchronize()
            ends.append(device.now)
            equal = equal and torch.equal(out, expected)
    peak_ok = streamer.meter.peak_bytes == streamer.predicted_peak_bytes()
    streamer.remove()
    bound = max(sum_copy, sum(compute.values())) + max(seconds for seconds, _ in stages.values())
    by = sorted({stage for _, stage in stages.values()})
    return CaseResult(case, depth, ends[-1] - ends[-2], bound, "+".join(by), equal, peak_ok,
                   device.blocked_s - blocked, device.copier_wait_s - waited, buffers)


def cases(uniform_compute: bool = False) -> list[Case]:
    grid = [Case(tier, depth, model) for tier in TIERS for depth in DEPTHS for model in MODELS]
    uneven = [Case(tier, None, "balanced", shape="uneven", uniform_compute=uniform_compute) for tier in TIERS]
    return [*grid, *uneven, Case(HostingTier.PAGEABLE, 2, "balanced", shape="slow-copier")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="40 layers of 128, 3 steps (default 60 of 256, 4)")
    parser.add_argument("--pinned-GBps", type=float, default=25.0)
    parser.add_argument("--pageable-GBps", type=float, default=10.0)
    parser.add_argument("--host-memcpy-GBps", type=float, default=12.0)
    parser.add_argument("--uneven-uniform-compute", action="store_true",
                        help="uneven cases: every layer computes alike while bytes differ (the window must "
                             "bank the double blocks' copy deficit)")
    args = parser.parse_args()
    layers, dim, steps = (40, 128, 3) if args.quick else (60, 256, 4)
    link = SimLink(pinned_Bps=args.pinned_GBps * 1e9, pageable_Bps=args.pageable_GBps * 1e9,
                   mapped_Bps=args.pageable_GBps * 1e9, host_memcpy_Bps=args.host_memcpy_GBps * 1e9)
    print(f"simulated link: {link}; {layers} layers of {dim}x{dim}; overheads per mean layer DMA t: copy latency "
          f"{COPY_LATENCY_T} t, launch {LAUNCH_T} t, copier jitter +-{JITTER:.0%}")
    print(f"{'case':42} {'step us':>9} {'bound us':>9} {'ratio':>6} {'copy bound by':14} {'blocked us':>10} "
          f"{'copier wait us':>14} bitwise peak=pred")
    outcomes = []
    for case in cases(args.uneven_uniform_compute):
        o = run_case(case, layers, dim, steps, link)
        outcomes.append(o)
        planned_as = f"{o.depth} (planned, staging {o.staging_buffers})"
        print(f"{case.name.replace('planned', planned_as):42} {o.step_s * 1e6:>9.3f} {o.bound_s * 1e6:>9.3f} {o.ratio:>6.3f} {o.copy_bound_by:14} "
              f"{o.blocked_s * 1e6:>10.3f} {o.copier_wait_s * 1e6:>14.3f} {o.bitwise_equal!s:7} {o.peak_predicted}",
              flush=True)
    control = run_case(Case(HostingTier.PAGEABLE, 1, "balanced", staging=False), layers, dim, steps, link)
    print(f"negative control (balanced, pageable, depth 1, staging off): ratio {control.ratio:.3f}")
    real = h200.run_all()
    print(f"{'h200 case':70} {'step ms':>8} {'device ms':>9} {'sim/dev':>7} bitwise")
    for o in real:
        row = o.as_json()
        device = f"{row['device_step_s'] * 1e3:9.1f} {row['sim_over_device']:7.3f}" if row["device_step_s"] else f"{'-':>9} {'-':>7}"
        print(f"{row['name']:70} {o.step_s * 1e3:8.1f} {device} {o.bitwise_equal}", flush=True)
    real_summary = h200.summary(real)
    print(f"h200 summary: {real_summary}")
    print(json.dumps({
        "bench": "sim_overlap", "quick": args.quick, "layers": layers, "link": dataclasses.asdict(link),
        "uneven_uniform_compute": args.uneven_uniform_compute,
        "overheads_per_layer_dma": {"copy_latency": COPY_LATENCY_T, "launch": LAUNCH_T, "copier_jitter": JITTER},
        "cases": [{"name": o.case.name, "shape": o.case.shape, "tier": o.case.tier.value, "depth": o.depth,
                   "staging_buffers": o.staging_buffers, "depth_planned": o.case.depth is None,
                   "model": o.case.model, "ratio": round(o.ratio, 4), "step_s": o.step_s, "bound_s": o.bound_s,
                   "copy_bound_by": o.copy_bound_by, "blocked_s": o.blocked_s, "copier_wait_s": o.copier_wait_s,
                   "bitwise_equal": o.bitwise_equal, "peak_equals_prediction": o.peak_predicted}
                  for o in outcomes],
        "max_ratio": round(max(o.ratio for o in outcomes), 4),
        "negative_control_ratio": round(control.ratio, 4),
        "h200_cases": [o.as_json() for o in real],
        "h200_summary": real_summary,
        "all_bitwise_equal": all(o.bitwise_equal for o in [*outcomes, control, *real]),
        "all_peaks_predicted": all(o.peak_predicted for o in [*outcomes, control]),
    }))


if __name__ == "__main__":
    main()
