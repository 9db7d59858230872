"""GPU check: step time and peak device memory, side by side, for the ways to run a denoiser.

- speed: the whole model resident on the device;
- layerwise (pinned), layerwise_pageable, layerwise_mapped: our streaming engine with every layer
  in that hosting tier, prefetch depth 1; pageable and mapped layers copy through pinned staging
  buffers filled by a host thread;
- layerwise_pageable_unstaged: pageable with staging switched off (the driver's blocking copy), the
  negative control that shows what staging fixes;
- group offload: diffusers' ``apply_group_offloading(block_level, 1 block per group, use_stream=True)``,
  the peer implementation;
- layerwise_fp8: pinned, FP8 host weights, against ``speed_fp8_reference`` (the resident model put
  through ``fake_quantize_``: its bitwise reference); layerwise_fp8_fused: the same with the widen
  fused into one compiled pass per group (``WidenMode.FUSED``, what block compile turns on);
on (a) the zoo's medium Wan denoiser, (b) real-size Wan2.1-1.3B with random weights at 6 latent
frames (its mapped way loads the weights saved to a safetensors folder, as from_pretrained maps
them) and (c) the same at 1 latent frame (speed, pinned, FP8; the median of at least 5 steps:
the image regime, launch-bound), plus measured pinned, pageable and staged host->device bandwidth
and the fill probe's host memcpy rate. Each streamed way is also put
over its tier's bound ``max(speed step, streamed bytes / that tier's measured rate)`` (pinned for
pinned layers and group offload, staged for pageable and mapped, pageable for unstaged): 1.0 is
copy fully hidden behind compute (or compute behind copy). Peak memory is ``torch.cuda.max_memory_allocated``
(weights and activations). At the end, on CUDA, the engine's CUDA-only tests run
(``pytest tests/offload_core -k cuda``), and the activation model's CUDA calibration
(``bench/gpu_activations.py``: each zoo stage calibrated on two shapes with ``max_memory_allocated``,
predicting a held-out third), then ``bench/hook_cost.py --device cuda`` (the hooks' host time
with a real copy stream), FP8 widening, and last a tiling decoder's two-phase prediction against
``max_memory_allocated`` and its time against an untiled decode's (``bench/gpu_activations.py --tiled``:
reported, not judged), so one device run covers them. Without CUDA the script
still runs end to end on CPU with a cut-down real-size model (``--real-blocks``), skipping what
needs CUDA and saying so. Last line: one JSON object, whose ``summary`` holds the figures the run is
judged by (``bench/gpu_summary.py``) and ``failed`` lists what failed; exit 1 when
a streamed way's output is not bitwise equal to speed mode's, its measured weight peak is not the
prediction, or a CUDA test or sub-bench (a missed target included) exited non-zero.
"""
from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.gpu_models import (  # noqa: E402  (the repository root is on the path: run as a script or imported)
    file_mapped_fraction,
    inputs,
    layer_bytes,
    layers_of,
    mapped_copy,
    medium_denoiser,
    real_denoiser,
)
from bench.gpu_parts import (  # noqa: E402
    activation_comparison,
    cuda_tests,
    hook_cost,
    staged_sweep,
    tiled_decode_comparison,
    widen_cost,
    within,
)
from bench.gpu_summary import COMPUTE_BOUND_CASE, IMAGE_CASE, summary_of  # noqa: E402
from offload_core.fp8_widen import WidenMode  # noqa: E402
from offload_core.host.tier import HostingTier  # noqa: E402
from offload_core.layout import declared_layer_groups, resolve_layer_group  # noqa: E402
from offload_core.quant import WeightFormat, fake_quantize_  # noqa: E402
from offload_core.streaming.engine import StreamingConfig, apply_layer_streaming  # noqa: E402

CUDA = torch.cuda.is_available()
MiB = 2**20


def _sync():
    if CUDA:
        torch.cuda.synchronize()


def time_steps(model, kwargs, steps: int):
    """Seconds per step (best and median of ``steps`` after one warm-up) and the output of the last step."""
    with torch.no_grad():
        out = model(**kwargs)[0]
        _sync()
        if CUDA:
            torch.cuda.reset_peak_memory_stats()
        seconds = []
        for _ in range(steps):
            start = time.perf_counter()
            out = model(**kwargs)[0]
            _sync()
            seconds.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated() if CUDA else None
    return min(seconds), statistics.median(seconds), peak, out


# way -> (hosting tier, staged copies); "layerwise" is the pinned tier (the name CI reads).
LAYERWISE = {"layerwise": (HostingTier.PINNED, True), "layerwise_pageable": (HostingTier.PAGEABLE, True),
             "layerwise_mapped": (HostingTier.MAPPED, True),
             "layerwise_pageable_unstaged": (HostingTier.PAGEABLE, False), "layerwise_fp8": (HostingTier.PINNED, True),
             "layerwise_fp8_fused": (HostingTier.PINNED, True)}
FP8_WAYS = ("speed_fp8_reference", "layerwise_fp8", "layerwise_fp8_fused")
ALL_WAYS = ("speed", *(w for w in LAYERWISE if w not in FP8_WAYS), "group_offload", *FP8_WAYS)


def tier_rate(way: str, link: dict) -> float | None:
    """The measured rate a way's bytes reach the device at: pinned, staged (pageable and mapped
    through staging) or pageable (unstaged, and diffusers' group offload from pinned CPU copies)."""
    key = {"layerwise": "pinned_GBps", "layerwise_pageable": "staged_GBps", "layerwise_mapped": "staged_GBps",
           "layerwise_pageable_unstaged": "pageable_GBps", "group_offload": "pinned_GBps"}.get(way)
    return link[key] * 1e9 if key in link else None


def run_case(name: str, build, shape, steps: int, device, link: dict, mapped: bool = False,
             ways: tuple[str, ...] = ALL_WAYS, mapped_build=None) -> dict:
    """Every way of ``ways`` on a fresh ``build``; ``mapped_build`` builds the mapped way's model (a
    file-mapped copy), else ``build`` itself when ``mapped`` says its weights are mapped already."""
    dtype = torch.bfloat16 if CUDA else torch.float32
    rows, references, streamed = {}, {}, None
    for way in ways:
        if way == "layerwise_mapped" and not (mapped or mapped_build):
            rows[way] = {"skipped": "random weights are not on a file mapping"}
            continue
        if way == "group_offload" and not CUDA:
            rows[way] = {"skipped": "diffusers' use_stream=True needs CUDA streams"}
            continue
        model = (mapped_build if way == "layerwise_mapped" and mapped_build else build)(dtype)
        streamed = layer_bytes(model) if streamed is None else streamed
        kwargs = inputs(model, *shape, device, dtype)
        extra = {}
        if way.startswith("speed"):
            model.to(device)
            if way == "speed_fp8_reference":
                # On the device: ~1 s, where the host's table-lookup widen of 1.3 B weights takes ~50 s
                # of one thread. quantize_fp8 is a correctly rounded division, exact frexp/ldexp and a
                # cast of clamped values: the same q and scales as the engine's on the host.
                fake_quantize_(layers_of(model))
        elif way.startswith("layerwise"):
            if way == "layerwise_mapped":  # that the MAPPED tier's bytes really are the file's pages
                extra["file_mapped_fraction"] = file_mapped_fraction(layers_of(model))
            tier, staged = LAYERWISE[way]
            keys = [f"{g}.{i}" for g in declared_layer_groups(model)
                    for i in range(len(resolve_layer_group(model, g).layers))]
            streamer = apply_layer_streaming(model, device, StreamingConfig(
                prefetch_depth=1, hosting={k: tier for k in keys}, staged_copies=staged,
                weights=WeightFormat.FP8 if way in FP8_WAYS else WeightFormat.NATIVE,
                widen=WidenMode.FUSED if way == "layerwise_fp8_fused" else WidenMode.EAGER))
            extra |= {"predicted_weight_peak_bytes": streamer.predicted_peak_bytes(),
                     "staging_bytes": streamer.staging_bytes}
        else:
            from diffusers.hooks import apply_group_offloading

            apply_group_offloading(model, onload_device=device, offload_type="block_level",
                                   num_blocks_per_group=1, use_stream=True)
        seconds, median, peak, out = time_steps(model, kwargs, steps)
        if way.startswith("layerwise"):
            extra["measured_weight_peak_bytes"] = streamer.meter.peak_bytes
            streamer.remove()  # unlocks the page-locked layer buffers (cudaHostUnregister) before they go
        # FP8 against the fake-quantized resident model (its reference), every other way against speed
        kind = "fp8" if way in FP8_WAYS else "native"
        reference = references.setdefault(kind, out)
        rows[way] = {"step_s": round(seconds, 4), "median_step_s": round(median, 4), "peak_allocated_bytes": peak,
                     "bitwise_equal_to_speed": bool(torch.equal(out, reference)), **extra}
        if kind == "fp8":
            rows[way]["reference"] = "speed_fp8_reference"
        del model, kwargs, out
        gc.collect()
        if CUDA:
            torch.cuda.empty_cache()
    base = rows["speed"]
    for way, row in rows.items():
        if "step_s" in row:
            row["step_vs_speed"] = round(row["step_s"] / base["step_s"], 3)
            if CUDA:
                row["peak_vs_speed"] = round(row["peak_allocated_bytes"] / base["peak_allocated_bytes"], 3)
            rate = tier_rate(way, link)
            if rate is not None:  # per tier: over max(speed step, bytes / that tier's measured rate)
                bound = max(base["step_s"], streamed / rate)
                row["bound_s"] = round(bound, 4)
                row["step_vs_bound"] = round(row["step_s"] / bound, 3)
    return {"case": name, "input_shape": list(shape), "streamed_bytes_per_step": streamed, "rows": rows}


def failures(results: list[dict], runs: dict[str, dict]) -> list[str]:
    """What failed: a streamed way whose output is not bitwise equal to speed mode's or whose
    measured weight peak is not the prediction, and any sub-run (tests, benches) that exited non-zero."""
    failed = []
    for result in results:
        for way, row in result["rows"].items():
            if not way.startswith("layerwise") or "skipped" in row:
                continue
            if not row["bitwise_equal_to_speed"]:
                failed.append(f"{result['case']}/{way}: bitwise_equal_to_speed")
            if row["measured_weight_peak_bytes"] != row["predicted_weight_peak_bytes"]:
                failed.append(f"{result['case']}/{way}: measured_weight_peak_bytes "
                              f"{row['measured_weight_peak_bytes']} != predicted {row['predicted_weight_peak_bytes']}")
    failed += [f"{name}: exit {run['returncode']}" for name, run in runs.items() if run.get("returncode", 0)]
    return failed


# In the order they run; the summary reads the second (6 frames) and the third (the image regime) by name.
CASES = ("medium-wan-denoiser", COMPUTE_BOUND_CASE, IMAGE_CASE)


def chosen_cases(text: str) -> list[str]:
    """``--cases``: names joined by commas, '' for none; an unknown name is refused, naming the cases."""
    cases = [name for name in text.split(",") if name]
    if unknown := sorted(set(cases) - set(CASES)):
        raise ValueError(f"--cases: unknown {unknown}; the cases are {list(CASES)}")
    return cases


def bandwidth() -> dict:
    if not CUDA:
        return {"skipped": "host->device bandwidth is measured on CUDA only"}
    from offload_core.streaming.link import measure_link

    link = measure_link(torch.device("cuda"))
    return {"pinned_GBps": round(link.pinned_Bps / 1e9, 2), "pageable_GBps": round(link.pageable_Bps / 1e9, 2),
            "staged_GBps": round(link.staged_Bps / 1e9, 2), "memcpy_GBps": round(link.host_memcpy_Bps / 1e9, 2),
            "copier_threads": link.copier_threads, "omp_num_threads": os.environ.get("OMP_NUM_THREADS")}


def print_case(result: dict) -> None:
    print(f"\n{result['case']} {tuple(result['input_shape'])}: streams "
          f"{result['streamed_bytes_per_step'] / MiB:.1f} MiB per step")
    print(f"  {'way':27} {'step s':>9} {'median':>8} {'vs speed':>8} {'vs bound':>8} {'peak MiB':>10} {'vs speed':>8}  bitwise")
    for way, row in result["rows"].items():
        if "skipped" in row:
            print(f"  {way:27} skipped: {row['skipped']}")
            continue
        peak = row["peak_allocated_bytes"]
        print(f"  {way:27} {row['step_s']:>9.4f} {row['median_step_s']:>8.4f} {row['step_vs_speed']:>8.2f} "
              f"{row.get('step_vs_bound', float('nan')):>8.2f} "
              f"{(peak / MiB if peak else float('nan')):>10.1f} {row.get('peak_vs_speed', float('nan')):>8.2f}  "
              f"{row['bitwise_equal_to_speed']}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3 if CUDA else 1)
    parser.add_argument("--real-blocks", type=int, default=None if CUDA else 2,
                        help="cap Wan2.1-1.3B's 30 blocks (default: all on CUDA, 2 on CPU)")
    parser.add_argument("--require-cuda", action="store_true", help="exit 2 when CUDA is not available")
    parser.add_argument("--cuda-tests-timeout", type=int, default=150,
                        help="seconds for the CUDA-only tests at the end (0: do not run them)")
    parser.add_argument("--activations-timeout", type=int, default=45,
                        help="seconds for the activation model's CUDA calibration, after the tests (0: skip)")
    parser.add_argument("--widen-timeout", type=int, default=60,
                        help="seconds for FP8 widening's cost on a Wan2.1-14B block, last (0: skip)")
    parser.add_argument("--hook-cost-timeout", type=int, default=60,
                        help="seconds for bench/hook_cost.py --device cuda, after the calibration (0: skip)")
    parser.add_argument("--tiled-timeout", type=int, default=40,
                        help="seconds for a tiling decoder's CUDA comparison (bench/gpu_activations.py --tiled), last, "
                             "in what the budget leaves (0: skip)")
    parser.add_argument("--staged-timeout", type=int, default=40,
                        help="seconds for bench/staged_sweep.py, right after the link probe (0: skip)")
    parser.add_argument("--cases", default=",".join(CASES),
                        help="cases to run, comma-separated ('' for none): a rerun of what a fix touched")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="seconds the whole run may take: a sub-bench gets what is left of it, less a "
                             "few seconds for the report (default: no bound)")
    args = parser.parse_args()
    try:
        cases = chosen_cases(args.cases)
    except ValueError as error:
        parser.error(str(error))
    budget = None if args.budget_s is None else time.monotonic() + args.budget_s
    if args.require_cuda and not CUDA:
        parser.exit(2, "gpu_check: --require-cuda given but torch sees no CUDA device\n")
    logging.basicConfig(level=logging.WARNING)
    for probe in ("offload_core.streaming.link", "offload_core.streaming.fill_threads"):
        logging.getLogger(probe).setLevel(logging.INFO)  # one line each per process: the rates and the cap
    device = torch.device("cuda" if CUDA else "cpu")
    # Medium: 2 latent frames of 16x16 (2*8*8 = 128 tokens). Real: 480x832 at 21 frames -> 6 latent
    # frames x 60x104 latents = 9360 tokens, a quarter of the 81-frame default, so all three ways
    # fit in the 8-minute budget; on CPU a 2x8x8 latent keeps it to seconds.
    medium_shape = (2, 16, 16, 8)
    real_shape = (6, 60, 104, 512) if CUDA else (2, 8, 8, 8)
    image_shape = (1, 60, 104, 512) if CUDA else (1, 8, 8, 8)  # one latent frame: an image
    print(f"device: {torch.cuda.get_device_name() if CUDA else 'cpu (CUDA-only parts skipped)'}", flush=True)
    # What is imported lives for the run: frozen, the collection after each way (which frees the model
    # before the next way's peak is measured) walks only what the ways made, not diffusers' objects too.
    from diffusers import WanTransformer3DModel  # noqa: F401
    gc.collect()
    gc.freeze()
    link = bandwidth()
    print(f"host->device bandwidth: {link}", flush=True)
    staged = within(budget, "staged", args.staged_timeout, staged_sweep)
    real = lambda dt: real_denoiser(dt, args.real_blocks)  # noqa: E731
    results = []
    with tempfile.TemporaryDirectory(prefix="gpu-check-mapped-") as folder:
        for name, build, shape, steps, options in (
                ("medium-wan-denoiser", medium_denoiser, medium_shape, args.steps, {"mapped": True}),
                ("wan2.1-1.3b-random", real, real_shape, args.steps,
                 {"mapped_build": mapped_copy(real, Path(folder))}),
                # the image regime: the median of at least 5 steps (the 1-frame step varied 1.08-1.53x)
                ("wan2.1-1.3b-random-1frame", real, image_shape, max(5, args.steps),
                 {"ways": ("speed", "layerwise", *FP8_WAYS)})):
            if name not in cases:
                continue
            result = run_case(name, build, shape, steps, device, link, **options)
            results.append(result)
            print_case(result)
    tests = within(budget, "cuda-tests", args.cuda_tests_timeout, cuda_tests)
    calibration = within(budget, "activations", args.activations_timeout, activation_comparison)
    hooks = within(budget, "hook-cost", args.hook_cost_timeout, hook_cost)
    widen = within(budget, "widen", args.widen_timeout, widen_cost)
    tiled = within(budget, "tiled", args.tiled_timeout, tiled_decode_comparison)  # reported, not judged
    failed = failures(results, {"cuda_tests": tests, "activations": calibration, "hook_cost": hooks, "widen": widen})
    figures = summary_of(link, results, hooks, calibration, tests)
    print(f"summary: {figures}")
    for failure in failed:
        print(f"MISSED: {failure}")
    print("\n" + json.dumps({"bench": "gpu_check", "cuda": CUDA, "bandwidth": link, "results": results,
                             "activations": calibration, "hook_cost": hooks, "cuda_tests": tests, "widen": widen,
                             "staged_sweep": staged, "tiled_decode": tiled, "summary": figures, "failed": failed}))
    if failed:
        sys.exit(1)


if __name__ == "__main__":
    main()
