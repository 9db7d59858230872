"""Host time the layer hooks cost per streamed layer, as the service runs them (``hook_us_per_layer``).

Every streamed layer's forward runs the engine's pre-hook (wait, prefetch, bind) and post-hook
(release), the meter's bookkeeping inside them, and the residency sampler's hooks. This times all
of them together on each layer: a timer hook registered first starts the clock and one registered
last stops it, on both sides of the layer's forward. The host copies issued inside the hooks are
timed on their own and subtracted (on a GPU they are asynchronous DMA, not host work).

Cases: the tiny zoo pipelines (Wan, Flux: every component streamed, as memory mode plans them) and
Wan2.1-14B's real transformer structure (40 blocks, 1,095 parameters) at a tiny width, since the
bookkeeping's cost depends on the parameter count, not on the bytes: one forward per request, and
``-denoise``, four forwards in one use as a Denoiser runs its steps (planned for four uses, so the
ring wraps; a layer bound again at its place points no parameter, ``streaming.unit``). The walk the meter and the
sampler used to do at every hook is timed beside it (``walk_us_per_hook``), for comparison.

    OMP_NUM_THREADS=1 .venv/bin/python bench/hook_cost.py --quick

The last line printed is one JSON object; ``hook_us_per_layer_max`` over its target exits 1 and is
listed in its ``failed`` (``bench/checks.py``).
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import checks  # noqa: E402
from offload_core.planner.facts import LinkFacts, PipelineFacts, Stage, profile_component  # noqa: E402
from offload_core.planner.search import PerformanceMode, plan_pipeline  # noqa: E402
from offload_core.residency.lifecycle import PipelineResidency  # noqa: E402

LINK = LinkFacts(pinned_Bps=25e9, pageable_Bps=10e9, measured=False)
# Wan2.1-14B at a width where a forward takes milliseconds; every tensor of the real model is kept
# (heads, qk norms, cross-attention norms), so the parameter count is the real 1,095.
TINY_WIDTH = {"num_attention_heads": 2, "attention_head_dim": 12, "ffn_dim": 32, "text_dim": 16,
              "freq_dim": 16, "in_channels": 4, "out_channels": 4, "rope_max_seq_len": 32}
WAN14B_PARAMETERS = 1095
HOOK_US_TARGET = 50.0  # per streamed layer, on every case: no growth with the parameter count


@dataclass(frozen=True)
class ProfileLine:
    """One function's own time inside the hooks (cProfile, one request), per layer forward."""

    function: str  # "ring.py:_issue", or a builtin: "<method 'record' of '_CudaEventBase' objects>"
    calls_per_layer: float
    own_us_per_layer: float  # cProfile's tottime: inflated by its own ~0.3 us per call, so shares count


@dataclass(frozen=True)
class HookCost:
    """What one case measured."""

    case: str
    layers: int  # streamed layers (all components)
    parameters: int  # parameters of all components
    layer_forwards: int  # streamed-layer forwards per request
    # Least over requests of (hook time - copy time) / layer forwards: other processes' load only
    # ever adds time (cold caches after a context switch), so the least is the hooks' own cost.
    hook_us_per_layer: float
    hook_us_per_layer_median: float
    hooks_alone_us_per_layer: float  # the two hooks back to back, no compute between (warm caches)
    copy_us_per_layer: float  # the host copies inside the hooks, subtracted above
    walk_us_per_hook: float  # one walk over every component's parameters (what each hook used to pay, x2)
    profile: tuple[ProfileLine, ...] = ()  # what the launch thread does inside the hooks, one profiled request


class _HookClock:
    """Start/stop timer hooks around every hook of the given layer modules; copy time kept apart."""

    def __init__(self):
        self.hook_ns = 0
        self.copy_ns = 0
        self.copied_bytes = 0  # what the timed copies returned: checked against the streamers' count
        self.forwards = 0
        self._start = 0
        self.profiler: cProfile.Profile | None = None  # set: every hook window is profiled too

    def begin(self, *_args) -> None:
        self._start = time.thread_time_ns()
        if self.profiler is not None:
            self.profiler.enable()

    def end(self, *_args) -> None:
        if self.profiler is not None:
            self.profiler.disable()
        self.hook_ns += time.thread_time_ns() - self._start

    def end_pre(self, *_args) -> None:
        self.forwards += 1
        self.end()

    def install(self, layer_modules, hosts) -> None:
        for module in layer_modules:
            module.register_forward_pre_hook(self.begin, prepend=True)
            module.register_forward_pre_hook(self.end_pre)  # last: after the engine, meter and sampler
            module.register_forward_hook(self.begin, prepend=True, always_call=True)
            module.register_forward_hook(self.end, always_call=True)
        for host in hosts:
            # Every copy of hosted bytes goes through copy_host_bytes (copy_to calls it too, through
            # the instance): timing copy_to alone missed the ring's copies from 1811ccd on, and the
            # copies were counted as hook time (tiny Flux 25-27 -> 42-70 us per layer on this VM).
            host.copy_host_bytes = self._timed_copy(host.copy_host_bytes)

    def _timed_copy(self, copy: Callable) -> Callable:
        def timed(*args, **kwargs):
            start = time.thread_time_ns()
            try:
                copied = copy(*args, **kwargs)
            finally:
                self.copy_ns += time.thread_time_ns() - start
            self.copied_bytes += copied
            return copied
        return timed

    def reset(self) -> None:
        self.hook_ns = self.copy_ns = self.copied_bytes = self.forwards = 0


def measure_case(name: str, components: dict[str, nn.Module], stages, call: Callable[[], object],
                 requests: int, device: str = "cpu", uses: int = 1) -> HookCost:
    """Stream every component as memory mode plans it for ``uses`` uses per request, run ``requests``
    requests, time the hooks."""
    profiles = tuple(profile_component(n, m, uses_per_request=uses) for n, m in components.items())
    facts = PipelineFacts(profiles, stages, 1 << 40, LINK, 1 << 34, device_name=device)
    res = PipelineResidency.apply(components, plan_pipeline(facts, PerformanceMode.MEMORY), device)
    streamers = [c.streamer for c in res.components.values() if c.streamer is not None]
    clock = _HookClock()
    clock.install([layer.module for s in streamers for layer in s.layers],
                  [layer.host for s in streamers for layer in s.layers])
    per_layer, copies = [], []
    try:
        with torch.no_grad():
            for request in range(requests + 1):  # the first request arms the rings: not counted
                clock.reset()
                with res.following_calls():
                    call()
                check_copies_timed(clock, streamers)
                res.finish_request()
                if request:
                    per_layer.append((clock.hook_ns - clock.copy_ns) / clock.forwards / 1e3)
                    copies.append(clock.copy_ns / clock.forwards / 1e3)
        forwards = clock.forwards
        profile = _profiled_request(res, clock, call, streamers)
        hot = _hooks_alone(res, streamers, clock)
        start = time.thread_time_ns()
        for c in res.components.values():
            c.meter.walk()
        walk_us = (time.thread_time_ns() - start) / 1e3
    finally:
        res.remove()
    return HookCost(name, sum(len(s.layers) for s in streamers),
                    sum(len(list(m.parameters())) for m in components.values()), forwards,
                    min(per_layer), statistics.median(per_layer), hot, statistics.median(copies), walk_us, profile)


def _profiled_request(res: PipelineResidency, clock: _HookClock, call: Callable[[], object], streamers,
                      top: int = 12) -> tuple[ProfileLine, ...]:
    """One more request with cProfile on inside every hook window: the functions with the most own
    time per layer forward (the timed figures come from the unprofiled requests)."""
    clock.reset()
    clock.profiler = cProfile.Profile()
    try:
        with torch.no_grad(), res.following_calls():
            call()
        check_copies_timed(clock, streamers)
        res.finish_request()
    finally:
        profiler, clock.profiler = clock.profiler, None
    forwards = max(1, clock.forwards)
    rows = sorted(pstats.Stats(profiler).stats.items(), key=lambda item: -item[1][2])[:top]
    return tuple(ProfileLine(_label(key), round(calls / forwards, 2), round(own_s / forwards * 1e6, 2))
                 for key, (_, calls, own_s, _, _) in rows)


def _label(key: tuple[str, int, str]) -> str:
    file, _, function = key
    return function if file == "~" else f"{Path(file).name}:{function}"


def check_copies_timed(clock: _HookClock, streamers) -> None:
    """Every byte the streamers copied in this request went through the copy timer, or the copies
    would count as hook time: raises naming both counts."""
    copied = sum(s.bytes_copied for s in streamers)
    if clock.copied_bytes != copied:
        raise RuntimeError(f"the copy timer saw {clock.copied_bytes} B of the {copied} B the streamers copied: "
                           "a copy path bypasses HostLayer.copy_host_bytes, and its time would count as hook time")


def _hooks_alone(res: PipelineResidency, streamers, clock: _HookClock, rounds: int = 20) -> float:
    """The engine's two hooks called back to back on every streamed layer, in execution order.

    No layer compute runs between them, so caches stay warm and other processes' load touches
    few samples: the hooks' own cost, beside the in-request figure that a loaded machine inflates.
    """
    names = [n for n, c in res.components.items() if c.streamer is not None]
    res.prepare_for_use(names)
    clock.reset()
    start = time.thread_time_ns()
    for _ in range(rounds):
        for streamer in streamers:
            for layer in streamer.layers:
                layer.pre_forward()
                layer.post_forward()
    elapsed = time.thread_time_ns() - start - clock.copy_ns
    res.finish_use(names)
    return elapsed / (rounds * sum(len(s.layers) for s in streamers)) / 1e3


def wan14b_structure(device: str = "cpu"):
    """Wan2.1-14B's transformer (40 blocks, 1,095 parameters) at a tiny width, with its inputs."""
    from diffusers import WanTransformer3DModel

    from offload_core.planner.real_models import component_spec

    config = dict(component_spec("wan2.1-t2v-14b", "transformer").config)
    config.update(TINY_WIDTH)
    torch.manual_seed(0)
    model = WanTransformer3DModel.from_config(config).eval()
    count = len(list(model.parameters()))
    assert count == WAN14B_PARAMETERS and len(model.blocks) == 40, f"{count} parameters, {len(model.blocks)} blocks"
    g = torch.Generator().manual_seed(1)
    inputs = {"hidden_states": torch.randn(1, 4, 1, 8, 8, generator=g).to(device),
              "timestep": torch.tensor([500], device=device),
              "encoder_hidden_states": torch.randn(1, 6, 16, generator=g).to(device), "return_dict": False}
    return {"transformer": model}, (Stage("denoise", ("transformer",)),), lambda: model(**inputs)


def _materialized(components: dict[str, nn.Module]) -> dict[str, nn.Module]:
    for module in components.values():
        for p in module.parameters():
            p.data = p.data.clone()  # fresh allocations, not views of the file mapping
    return components


def tiny_wan():
    from diffusers import WanPipeline

    from zoo.tiny import ensure_tiny_wan

    pipe = WanPipeline.from_pretrained(ensure_tiny_wan())
    pipe.set_progress_bar_config(disable=True)
    comps = _materialized({"text_encoder": pipe.text_encoder, "transformer": pipe.transformer, "vae": pipe.vae})
    stages = (Stage("encode", ("text_encoder",)), Stage("denoise", ("transformer",)), Stage("decode", ("vae",)))
    return comps, stages, lambda: pipe("a cat", height=16, width=16, num_frames=5, num_inference_steps=2,
                                       generator=torch.Generator().manual_seed(0), output_type="pt")


def tiny_flux():
    from diffusers import FluxPipeline

    from zoo.tiny import ensure_tiny_flux

    pipe = FluxPipeline.from_pretrained(ensure_tiny_flux())
    pipe.set_progress_bar_config(disable=True)
    comps = _materialized({"text_encoder": pipe.text_encoder, "text_encoder_2": pipe.text_encoder_2,
                           "transformer": pipe.transformer, "vae": pipe.vae})
    stages = (Stage("encode", ("text_encoder", "text_encoder_2")), Stage("denoise", ("transformer",)),
              Stage("decode", ("vae",)))
    return comps, stages, lambda: pipe("a cat", height=32, width=32, num_inference_steps=2, max_sequence_length=16,
                                       generator=torch.Generator().manual_seed(0), output_type="pt")


CASES = {"tiny-wan": tiny_wan, "tiny-flux": tiny_flux, "wan2.1-14b-structure": wan14b_structure}
DENOISE_STEPS = 4  # the -denoise case's forwards per use


def wan14b_denoise(device: str = "cpu"):
    """The 14B structure's forward :data:`DENOISE_STEPS` times in one use (a Denoiser's steps)."""
    components, stages, forward = wan14b_structure(device)
    return components, stages, lambda: [forward() for _ in range(DENOISE_STEPS)]


def measure_all(requests: int, device: str = "cpu") -> list[HookCost]:
    denoise = measure_case("wan2.1-14b-structure-denoise", *wan14b_denoise(device), requests, device,
                           uses=DENOISE_STEPS)
    if device != "cpu":
        # On a GPU, the 14B structure only: the hooks' cost depends on the parameter count, and the
        # tiny pipelines' own device handling is not what is measured here.
        return [measure_case("wan2.1-14b-structure", *wan14b_structure(device), requests, device), denoise]
    return [*(measure_case(name, *build(), requests) for name, build in CASES.items()), denoise]


def print_table(costs: list[HookCost]) -> dict:
    """Print one row per case; returns the JSON fields (per case and the max)."""
    print(f"{'case':28} {'layers':>6} {'params':>6} {'fwd/req':>7} {'hook us/layer':>13} {'(median)':>8} "
          f"{'hooks alone':>11} {'copy us/layer':>13} {'walk us/hook (before)':>21}")
    for c in costs:
        print(f"{c.case:28} {c.layers:>6} {c.parameters:>6} {c.layer_forwards:>7} {c.hook_us_per_layer:>13.1f} "
              f"{c.hook_us_per_layer_median:>8.1f} {c.hooks_alone_us_per_layer:>11.1f} {c.copy_us_per_layer:>13.1f} "
              f"{c.walk_us_per_hook:>21.1f}")
    for c in costs:
        print(f"{c.case}: own time inside the hooks per layer forward, one profiled request (cProfile adds ~0.3 us a call)")
        for line in c.profile:
            print(f"  {line.own_us_per_layer:7.2f} us {line.calls_per_layer:6.2f} calls  {line.function}")
    worst = max(c.hook_us_per_layer for c in costs)
    print(f"hook_us_per_layer_max = {worst:.1f} us (target <= {HOOK_US_TARGET:g}, the same on every case: no growth with parameters)")
    return {"hook_us_per_layer": {c.case: round(c.hook_us_per_layer, 2) for c in costs},
            "hook_us_per_layer_median": {c.case: round(c.hook_us_per_layer_median, 2) for c in costs},
            "hooks_alone_us_per_layer": {c.case: round(c.hooks_alone_us_per_layer, 2) for c in costs},
            "walk_us_per_hook": {c.case: round(c.walk_us_per_hook, 2) for c in costs},
            "profile": {c.case: [[line.function, line.calls_per_layer, line.own_us_per_layer] for line in c.profile]
                        for c in costs},
            "hook_us_per_layer_max": round(worst, 2)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="5 timed requests per case instead of 15")
    parser.add_argument("--device", default="cpu", help="cuda: the 14B structure on a real GPU (host time per hook)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    fields = print_table(measure_all(5 if args.quick else 15, args.device))
    target = checks.at_most("hook_us_per_layer_max", fields["hook_us_per_layer_max"], HOOK_US_TARGET)
    return checks.finish({"bench": "hook_cost", "device": args.device, **fields}, [target])


if __name__ == "__main__":
    sys.exit(main())
