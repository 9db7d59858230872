"""GPU check: step time and peak device memory, side by side, for the ways to run a denoiser.

- speed: the whole model resident on the device;
- layerwise (pinned), layerwise_pageable, layerwise_mapped: our streaming engine with every layer
  in that hosting tier, prefetch depth 1; pageable and mapped layers copy through pinned staging
  buffers filled by a host thread;
- layerwise_pageable_unstaged: pageable with staging switched off (the driver's blocking copy), the
  negative control that shows what staging fixes;
- group offload: diffusers' ``apply_group_offloading(block_level, 1 block per group, use_stream=True)``,
  the peer implementation;
on (a) the zoo's medium Wan denoiser and (b) real-size Wan2.1-1.3B blocks with random weights,
plus measured pinned, pageable and staged host->device bandwidth. Each streamed way is also put
over its tier's bound ``max(speed step, streamed bytes / that tier's measured rate)`` (pinned for
pinned layers and group offload, staged for pageable and mapped, pageable for unstaged): 1.0 is
copy fully hidden behind compute (or compute behind copy). Peak memory is ``torch.cuda.max_memory_allocated``
(weights and activations). At the end, on CUDA, the engine's CUDA-only tests run
(``pytest tests/offload_core -k cuda``), and the activation model's CUDA calibration
(``bench/gpu_activations.py``: each zoo stage calibrated on two shapes with ``max_memory_allocated``,
predicting a held-out third), then ``bench/hook_cost.py --device cuda`` (the hooks' host time
with a real copy stream), so one device run covers them. Without CUDA the script
still runs end to end on CPU with a cut-down real-size model (``--real-blocks``), skipping what
needs CUDA and saying so. Last line: one JSON object, whose ``failed`` lists what failed; exit 1 when
a streamed way's output is not bitwise equal to speed mode's, its measured weight peak is not the
prediction, or a CUDA test or sub-bench (a missed target included) exited non-zero.
"""
from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from offload_core.host.tier import HostingTier  # noqa: E402
from offload_core.layout import declared_layer_groups, resolve_layer_group  # noqa: E402
from offload_core.streaming.engine import StreamingConfig, apply_layer_streaming  # noqa: E402

CUDA = torch.cuda.is_available()
MiB = 2**20


def medium_denoiser(dtype: torch.dtype):
    from diffusers import WanTransformer3DModel

    from zoo.tiny import ensure_medium_wan

    return WanTransformer3DModel.from_pretrained(ensure_medium_wan() / "transformer", torch_dtype=dtype).eval()


_REAL_WEIGHTS: dict[tuple, dict[str, torch.Tensor]] = {}


def real_denoiser(dtype: torch.dtype, blocks: int | None):
    """Wan2.1-1.3B's transformer at real size (``blocks`` caps the layer count), random weights.

    The weights are drawn once per run and cloned into each build: drawing 1.4 B random numbers
    takes ~15 s, and the check builds the model once per way.
    """
    from diffusers import WanTransformer3DModel

    config = json.loads((Path(__file__).resolve().parents[1] / "configs/models/real_model_configs.json").read_text())
    cfg = dict(config["wan2.1-t2v-1.3b"]["transformer"]["config"])
    if blocks is not None:
        cfg["num_layers"] = blocks
    with torch.device("meta"):
        model = WanTransformer3DModel.from_config(cfg)
    model = model.to_empty(device="cpu")
    keep = set(model._keep_in_fp32_modules or ())  # as from_pretrained(torch_dtype=...) keeps them
    weights = _REAL_WEIGHTS.get((dtype, blocks))
    if weights is None:
        generator = torch.Generator().manual_seed(0)
        weights = _REAL_WEIGHTS[(dtype, blocks)] = {}
        for name, p in model.named_parameters():  # random weights at a trained model's scale
            drawn = torch.randn(p.shape, generator=generator) * 0.02
            weights[name] = drawn if keep.intersection(name.split(".")) else drawn.to(dtype)
    for name, p in model.named_parameters():
        p.data = weights[name].clone()
    for b in model.buffers():
        b.zero_()
    return model.eval()


def inputs(model, frames: int, height: int, width: int, text_tokens: int, device, dtype):
    g = torch.Generator().manual_seed(1)
    cfg = model.config
    latent = torch.randn(1, cfg.in_channels, frames, height, width, generator=g)
    text = torch.randn(1, text_tokens, cfg.text_dim, generator=g)
    return {"hidden_states": latent.to(device, dtype), "timestep": torch.tensor([500], device=device),
            "encoder_hidden_states": text.to(device, dtype), "return_dict": False}


def _sync():
    if CUDA:
        torch.cuda.synchronize()


def time_steps(model, kwargs, steps: int):
    """Seconds per step (best of ``steps`` after one warm-up) and the output of the last step."""
    with torch.no_grad():
        out = model(**kwargs)[0]
        _sync()
        if CUDA:
            torch.cuda.reset_peak_memory_stats()
        best = float("inf")
        for _ in range(steps):
            start = time.perf_counter()
            out = model(**kwargs)[0]
            _sync()
            best = min(best, time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated() if CUDA else None
    return best, peak, out


# way -> (hosting tier, staged copies); "layerwise" is the pinned tier (the name CI reads).
LAYERWISE = {"layerwise": (HostingTier.PINNED, True), "layerwise_pageable": (HostingTier.PAGEABLE, True),
             "layerwise_mapped": (HostingTier.MAPPED, True),
             "layerwise_pageable_unstaged": (HostingTier.PAGEABLE, False)}


def tier_rate(way: str, link: dict) -> float | None:
    """The measured rate a way's bytes reach the device at: pinned, staged (pageable and mapped
    through staging) or pageable (unstaged, and diffusers' group offload from pinned CPU copies)."""
    key = {"layerwise": "pinned_GBps", "layerwise_pageable": "staged_GBps", "layerwise_mapped": "staged_GBps",
           "layerwise_pageable_unstaged": "pageable_GBps", "group_offload": "pinned_GBps"}.get(way)
    return link[key] * 1e9 if key in link else None


def run_case(name: str, build, shape, steps: int, device, link: dict, mapped: bool = False) -> dict:
    dtype = torch.bfloat16 if CUDA else torch.float32
    rows, reference, streamed = {}, None, None
    for way in ("speed", *LAYERWISE, "group_offload"):
        if way == "layerwise_mapped" and not mapped:
            rows[way] = {"skipped": "random weights are not on a file mapping"}
            continue
        if way == "group_offload" and not CUDA:
            rows[way] = {"skipped": "diffusers' use_stream=True needs CUDA streams"}
            continue
        model = build(dtype)
        streamed = layer_bytes(model) if streamed is None else streamed
        kwargs = inputs(model, *shape, device, dtype)
        extra = {}
        if way == "speed":
            model.to(device)
        elif way.startswith("layerwise"):
            tier, staged = LAYERWISE[way]
            keys = [f"{g}.{i}" for g in declared_layer_groups(model)
                    for i in range(len(resolve_layer_group(model, g).layers))]
            streamer = apply_layer_streaming(model, device, StreamingConfig(
                prefetch_depth=1, hosting={k: tier for k in keys}, staged_copies=staged))
            extra = {"predicted_weight_peak_bytes": streamer.predicted_peak_bytes(),
                     "staging_bytes": streamer.staging_bytes}
        else:
            from diffusers.hooks import apply_group_offloading

            apply_group_offloading(model, onload_device=device, offload_type="block_level",
                                   num_blocks_per_group=1, use_stream=True)
        seconds, peak, out = time_steps(model, kwargs, steps)
        if way.startswith("layerwise"):
            extra["measured_weight_peak_bytes"] = streamer.meter.peak_bytes
            streamer.remove()  # unlocks the page-locked layer buffers (cudaHostUnregister) before they go
        reference = out if reference is None else reference
        rows[way] = {"step_s": round(seconds, 4), "peak_allocated_bytes": peak,
                     "bitwise_equal_to_speed": bool(torch.equal(out, reference)), **extra}
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


def layer_bytes(model) -> int:
    """Bytes every step streams: each layer's flat layout (what the engine copies), all layers streamed."""
    from offload_core.layout import layer_parameters, plan_layer_layout

    return sum(plan_layer_layout(f"{g}.{i}", [(n, p.data) for n, p in layer_parameters(layer)]).nbytes
               for g in declared_layer_groups(model) for i, layer in enumerate(resolve_layer_group(model, g).layers))


def _repo_env() -> tuple[Path, dict]:
    """The repository root and an environment whose PYTHONPATH finds the project from a subprocess."""
    root = Path(__file__).resolve().parents[1]
    return root, {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))}


def _bench_json(args: list[str], timeout_s: int) -> dict:
    """One bench script in a subprocess: its table printed here, its last line (one JSON object) returned
    with returncode 0, or the returncode and the error's last line."""
    root, env = _repo_env()
    try:
        done = subprocess.run([sys.executable, *args], cwd=root, env=env, capture_output=True, text=True,
                              timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"returncode": 124, "summary": f"timed out after {timeout_s} s"}
    lines = done.stdout.strip().splitlines()
    print("\n" + "\n".join(lines[:-1]), done.stderr[-2000:] if done.returncode else "", sep="\n", flush=True)
    if done.returncode == 1 and lines and lines[-1].startswith("{"):  # a bench that missed a target still reports
        return {**json.loads(lines[-1]), "returncode": 1}
    if done.returncode or not lines:
        return {"returncode": done.returncode, "summary": done.stderr.strip().splitlines()[-1:]}
    return {"returncode": 0, **json.loads(lines[-1])}


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


def cuda_tests(timeout_s: int) -> dict:
    """The engine's CUDA-only tests (stream safety, staging on a real GPU), in a subprocess."""
    if not CUDA:
        return {"skipped": "the CUDA-only tests need CUDA"}
    root, env = _repo_env()
    try:
        done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs",
                               "tests/offload_core", "-k", "cuda"], cwd=root, env=env, capture_output=True,
                              text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as late:
        print(late.stdout[-4000:] if late.stdout else "", flush=True)
        return {"returncode": 124, "summary": f"timed out after {timeout_s} s"}
    print(done.stdout[-4000:], done.stderr[-2000:], sep="\n", flush=True)
    lines = done.stdout.strip().splitlines()
    return {"returncode": done.returncode, "summary": lines[-1] if lines else ""}


def activation_comparison(timeout_s: int) -> dict:
    """bench/gpu_activations.py on CUDA (a CPU calibration is not a CUDA one), in a subprocess: its
    table printed here, its JSON returned. On CPU the tests pin the same comparison."""
    if not CUDA:
        return {"skipped": "the CUDA calibration needs CUDA (tests/deployments/models/test_activation_features.py pins the CPU one)"}
    report = _bench_json(["bench/gpu_activations.py"], timeout_s)
    if report["returncode"]:
        return report
    return {"returncode": 0, "max_abs_error": report["max_abs_error"], "rows": report["rows"]}


def widen_cost(timeout_s: int) -> dict:
    """bench/widen_cost.py on CUDA, in a subprocess: FP8 widening's cost per real-size Wan2.1-14B block
    beside the copy it saves. On CPU the bench runs on its own (docs/benchmarks.md has its figures)."""
    if not CUDA:
        return {"skipped": "the widen's cost beside the pinned copy needs CUDA (bench/widen_cost.py runs on CPU alone)"}
    return _bench_json(["bench/widen_cost.py", "--device", "cuda"], timeout_s)


def bandwidth() -> dict:
    if not CUDA:
        return {"skipped": "host->device bandwidth is measured on CUDA only"}
    from offload_core.streaming.link import measure_link

    link = measure_link(torch.device("cuda"))
    return {"pinned_GBps": round(link.pinned_Bps / 1e9, 2), "pageable_GBps": round(link.pageable_Bps / 1e9, 2),
            "staged_GBps": round(link.staged_Bps / 1e9, 2)}


def hook_cost(timeout_s: int) -> dict:
    """bench/hook_cost.py --device cuda (the hooks' host time with a real copy stream and events)."""
    if not CUDA:
        return {"skipped": "bench/streaming.py --quick measures the hooks on CPU"}
    return _bench_json(["bench/hook_cost.py", "--device", "cuda"], timeout_s)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3 if CUDA else 1)
    parser.add_argument("--real-blocks", type=int, default=None if CUDA else 2,
                        help="cap Wan2.1-1.3B's 30 blocks (default: all on CUDA, 2 on CPU)")
    parser.add_argument("--require-cuda", action="store_true", help="exit 2 when CUDA is not available")
    parser.add_argument("--cuda-tests-timeout", type=int, default=120,
                        help="seconds for the CUDA-only tests at the end (0: do not run them)")
    parser.add_argument("--activations-timeout", type=int, default=45,
                        help="seconds for the activation model's CUDA calibration, after the tests (0: skip)")
    parser.add_argument("--widen-timeout", type=int, default=60,
                        help="seconds for FP8 widening's cost on a Wan2.1-14B block, last (0: skip)")
    parser.add_argument("--hook-cost-timeout", type=int, default=60,
                        help="seconds for bench/hook_cost.py --device cuda, after the calibration (0: skip)")
    args = parser.parse_args()
    if args.require_cuda and not CUDA:
        parser.exit(2, "gpu_check: --require-cuda given but torch sees no CUDA device\n")
    logging.basicConfig(level=logging.WARNING)
    device = torch.device("cuda" if CUDA else "cpu")
    # Medium: 2 latent frames of 16x16 (2*8*8 = 128 tokens). Real: 480x832 at 21 frames -> 6 latent
    # frames x 60x104 latents = 9360 tokens, a quarter of the 81-frame default, so all three ways
    # fit in the 8-minute budget; on CPU a 2x8x8 latent keeps it to seconds.
    medium_shape = (2, 16, 16, 8)
    real_shape = (6, 60, 104, 512) if CUDA else (2, 8, 8, 8)
    print(f"device: {torch.cuda.get_device_name() if CUDA else 'cpu (CUDA-only parts skipped)'}", flush=True)
    # What is imported lives for the run: frozen, the collection after each way (which frees the model
    # before the next way's peak is measured) walks only what the ways made, not diffusers' objects too.
    from diffusers import WanTransformer3DModel  # noqa: F401
    gc.collect()
    gc.freeze()
    link = bandwidth()
    print(f"host->device bandwidth: {link}", flush=True)
    results = []
    for name, build, shape, mapped in (
            ("medium-wan-denoiser", medium_denoiser, medium_shape, True),
            ("wan2.1-1.3b-random", lambda dt: real_denoiser(dt, args.real_blocks), real_shape, False)):
        result = run_case(name, build, shape, args.steps, device, link, mapped)
        results.append(result)
        print(f"\n{name} {shape}: streams {result['streamed_bytes_per_step'] / MiB:.1f} MiB per step")
        print(f"  {'way':27} {'step s':>9} {'vs speed':>8} {'vs bound':>8} {'peak MiB':>10} {'vs speed':>8}  bitwise")
        for way, row in result["rows"].items():
            if "skipped" in row:
                print(f"  {way:27} skipped: {row['skipped']}")
                continue
            peak = row["peak_allocated_bytes"]
            print(f"  {way:27} {row['step_s']:>9.4f} {row['step_vs_speed']:>8.2f} "
                  f"{row.get('step_vs_bound', float('nan')):>8.2f} "
                  f"{(peak / MiB if peak else float('nan')):>10.1f} {row.get('peak_vs_speed', float('nan')):>8.2f}  "
                  f"{row['bitwise_equal_to_speed']}", flush=True)
    tests = cuda_tests(args.cuda_tests_timeout) if args.cuda_tests_timeout else {"skipped": "--cuda-tests-timeout 0"}
    calibration = (activation_comparison(args.activations_timeout) if args.activations_timeout
                   else {"skipped": "--activations-timeout 0"})
    hooks = hook_cost(args.hook_cost_timeout) if args.hook_cost_timeout else {"skipped": "--hook-cost-timeout 0"}
    widen = widen_cost(args.widen_timeout) if args.widen_timeout else {"skipped": "--widen-timeout 0"}
    failed = failures(results, {"cuda_tests": tests, "activations": calibration, "hook_cost": hooks, "widen": widen})
    for failure in failed:
        print(f"MISSED: {failure}")
    print("\n" + json.dumps({"bench": "gpu_check", "cuda": CUDA, "bandwidth": link, "results": results,
                             "activations": calibration, "hook_cost": hooks, "cuda_tests": tests, "widen": widen,
                             "failed": failed}))
    if failed:
        sys.exit(1)


if __name__ == "__main__":
    main()
