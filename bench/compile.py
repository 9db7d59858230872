"""Compiled repeated blocks, resident and streamed: recompiles, compile seconds, eager/compiled ratios.

    .venv/bin/python bench/compile.py --quick                     # CPU: the tiny zoo Wan and Flux, inductor's C++ backend
    .venv/bin/python bench/compile.py --device cuda [--model wan2.1-1.3b --model flux-sized] [--blocks N]   # GPU

Per model, four copies: resident (plain), streamed (every layer PINNED, 2 slots), streamed with FP8
host weights, and the resident reference for FP8 (fake-quantized). Eager first (resident and
streamed step), then ``apply_block_compile`` on each with one bucket of the model's shapes, warmed
by ``warm_buckets`` (compile seconds per bucket), then 2 requests x each served shape on all four,
counting dynamo's graphs: ``recompiles_after_warmup`` (target 0) and
``streamed_bitwise_equal_resident_compiled`` (streamed == resident compiled, FP8 streamed == its
fake-quantized resident, every call: target true); compiled vs eager within torch.testing's tolerance
for the dtype. On a GPU also the issue's target: compiled streamed step <= 1.05 x max(compiled
resident step, the bytes a step streams / the link's pinned rate), native and FP8 (reported for FP8,
checked for native). Steps are wall-clock medians, interleaved round by round (CPU: inductor's kernels use OpenMP threads, which a
thread's CPU time would miss). Then, unless ``--no-cache-probe``, two fresh processes compile the tiny Wan
bucket with one new inductor cache dir: the second's compile seconds are what a restarted replica pays.
The last line printed is one JSON object; a missed target exits 1 (``bench/checks.py``).
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import checks  # noqa: E402
from offload_core.compile import (  # noqa: E402
    CompileConfig,
    RequestShape,
    ShapeBucket,
    apply_block_compile,
    warm_buckets,
)
from offload_core.host.tier import HostingTier  # noqa: E402
from offload_core.layout import declared_layer_groups, resolve_layer_group  # noqa: E402
from offload_core.quant import WeightFormat, fake_quantize_  # noqa: E402
from offload_core.streaming.engine import StreamingConfig, apply_layer_streaming  # noqa: E402

# Served shapes per model (pixels; frames are latent frames here). CPU: the tiny zoo at 2 shapes
# of one bucket; GPU: real-size Wan2.1-1.3B at 480x832, 1 and 6 latent frames, each its own bucket
# (a static graph per shape: the fastest kernels, the two shapes).
SHAPES = {"tiny-wan": (RequestShape(64, 64), RequestShape(64, 128), RequestShape(128, 128)),
          "tiny-flux": (RequestShape(128, 128), RequestShape(128, 256), RequestShape(256, 256)),
          "wan2.1-1.3b": (RequestShape(480, 832, 1), RequestShape(480, 832, 6)),
          "flux-sized": (RequestShape(1024, 1024),)}
# flux-sized: FLUX.1-dev's transformer config (configs/models/real_model_configs.json) with the block
# stack cut to --blocks double and 2 x --blocks single blocks (default 6: ~3.7 B parameters, 7.4 GB
# in bf16 per copy, four copies on the host), random weights: a FLUX-sized block at the real width.
FLUX_SIZED_BLOCKS = 6


def layers_of(model) -> list:
    return [m for g in declared_layer_groups(model) for m in resolve_layer_group(model, g).layers]


_FLUX_WEIGHTS: dict[tuple, dict[str, torch.Tensor]] = {}


def flux_sized(dtype: torch.dtype, blocks: int | None):
    """FLUX.1-dev's transformer at real width, ``blocks`` double and 2 x ``blocks`` single blocks,
    random weights drawn once per run (as bench/gpu_models.real_denoiser draws Wan's)."""
    from diffusers import FluxTransformer2DModel

    config = json.loads((Path(__file__).resolve().parents[1] / "configs/models/real_model_configs.json").read_text())
    cfg = dict(config["flux.1-dev"]["transformer"]["config"])
    n = blocks or FLUX_SIZED_BLOCKS
    cfg["num_layers"], cfg["num_single_layers"] = min(cfg["num_layers"], n), min(cfg["num_single_layers"], 2 * n)
    with torch.device("meta"):
        model = FluxTransformer2DModel.from_config(cfg)
    model = model.to_empty(device="cpu")
    weights = _FLUX_WEIGHTS.get((dtype, n))
    if weights is None:
        generator = torch.Generator().manual_seed(0)
        weights = _FLUX_WEIGHTS[(dtype, n)] = {name: (torch.randn(p.shape, generator=generator) * 0.02).to(dtype)
                                                for name, p in model.named_parameters()}
    for name, p in model.named_parameters():
        p.data = weights[name].clone()
    for b in model.buffers():
        b.zero_()
    return model.eval()


def load(name: str, dtype: torch.dtype, blocks: int | None):
    if name == "wan2.1-1.3b":
        from bench.gpu_models import real_denoiser

        return real_denoiser(dtype, blocks)
    if name == "flux-sized":
        return flux_sized(dtype, blocks)
    from diffusers import FluxTransformer2DModel, WanTransformer3DModel

    from zoo.tiny import ensure_tiny_flux, ensure_tiny_wan

    cls, folder = ((WanTransformer3DModel, ensure_tiny_wan) if name == "tiny-wan"
                   else (FluxTransformer2DModel, ensure_tiny_flux))
    model = cls.from_pretrained(folder() / "transformer", torch_dtype=dtype).eval()
    for param in model.parameters():  # fresh (aligned) allocations, as a device model holds
        param.data = param.data.clone()
    return model


def inputs(name: str, model, shape: RequestShape, device, dtype) -> dict:
    g = torch.Generator().manual_seed(shape.height * 31 + shape.width + shape.frames)
    cfg, b = model.config, shape.batch
    if name in ("tiny-flux", "flux-sized"):
        tokens, text = (shape.height // 16) * (shape.width // 16), 8 if name == "tiny-flux" else 512
        found = {"hidden_states": torch.randn(b, tokens, cfg.in_channels, generator=g),
                 "encoder_hidden_states": torch.randn(b, text, cfg.joint_attention_dim, generator=g),
                 "pooled_projections": torch.randn(b, cfg.pooled_projection_dim, generator=g),
                 "timestep": torch.full((b,), 0.5), "guidance": torch.full((b,), 3.5),
                 "img_ids": torch.zeros(tokens, 3), "txt_ids": torch.zeros(text, 3)}
    else:
        found = {"hidden_states": torch.randn(b, cfg.in_channels, shape.frames, shape.height // 8, shape.width // 8,
                                              generator=g),
                 "timestep": torch.full((b,), 500), "encoder_hidden_states": torch.randn(b, 16, cfg.text_dim, generator=g)}
    floats = {"hidden_states", "encoder_hidden_states", "pooled_projections"}
    return {k: v.to(device, dtype) if k in floats else v.to(device) for k, v in found.items()} | {"return_dict": False}


class Copy:
    """One copy of the model as a bench runs it: maybe streamed, maybe compiled."""

    def __init__(self, args, model, streamer=None):
        self.args, self.model, self.streamer, self.blocks = args, model, streamer, None

    def run(self, shape: RequestShape) -> torch.Tensor:
        with torch.no_grad():
            out = self.model(**inputs(self.args.model, self.model, shape, self.args.device, self.args.dtype))[0]
        if self.streamer is not None:
            self.streamer.finish_use(keep_resident=False)
        if self.args.device.type == "cuda":
            torch.cuda.synchronize(self.args.device)
        return out

    def once_s(self, shape: RequestShape) -> float:
        start = time.perf_counter()
        self.run(shape)
        return time.perf_counter() - start


def steps_s(copies: dict[str, Copy], served: tuple[RequestShape, ...], repeats: int) -> dict[str, dict]:
    """Median step per copy and shape, interleaved round by round so a burst of load on the shared
    machine hits every figure alike (a ratio's two sides are timed back to back)."""
    times: dict[str, dict] = {key: {s: [] for s in served} for key in copies}
    for _ in range(repeats):
        for shape in served:
            for key, copy in copies.items():
                times[key][shape].append(copy.once_s(shape))
    return {key: {s: statistics.median(t) for s, t in by_shape.items()} for key, by_shape in times.items()}


def build(args) -> dict[str, Copy]:
    device = args.device
    resident = Copy(args, load(args.model, args.dtype, args.blocks).to(device))
    reference8 = load(args.model, args.dtype, args.blocks)
    fake_quantize_(layers_of(reference8))
    copies = {"resident": resident, "resident_fp8": Copy(args, reference8.to(device))}
    for key, weights in (("streamed", WeightFormat.NATIVE), ("streamed_fp8", WeightFormat.FP8)):
        model = load(args.model, args.dtype, args.blocks)
        hosting = {f"{g}.{i}": HostingTier.PINNED for g in declared_layer_groups(model)
                   for i, _ in enumerate(resolve_layer_group(model, g).layers)}
        streamer = apply_layer_streaming(model, device, StreamingConfig(weights=weights, hosting=hosting))
        copies[key] = Copy(args, model, streamer)
    return copies


def measure(args) -> dict:
    shapes = SHAPES[args.model]
    buckets = ((ShapeBucket("all", shapes),) if args.device.type == "cpu"
               else tuple(ShapeBucket(str(s), (s,)) for s in shapes))
    served = shapes[1:] if args.device.type == "cpu" else shapes
    copies = build(args)
    eager = {s: copies["resident"].run(s) for s in served}
    timed = {k: copies[k] for k in ("resident", "streamed")}
    eager_s = steps_s(timed, served, args.repeats)
    config = CompileConfig(buckets=buckets, cache_dir=args.cache_dir)
    warm = {}
    for key, copy in copies.items():
        copy.blocks = apply_block_compile(copy.model, config)
        warm[key] = warm_buckets(copy.blocks, copy.run)
    before = copies["resident"].blocks.graphs_compiled()
    equal, tolerance = True, True
    for _ in range(2):  # 2 requests x every served shape, on every copy
        for shape in served:
            out = {key: copy.run(shape) for key, copy in copies.items()}
            equal &= torch.equal(out["streamed"], out["resident"]) and torch.equal(out["streamed_fp8"],
                                                                                out["resident_fp8"])
            try:
                torch.testing.assert_close(out["resident"], eager[shape])
            except AssertionError:
                tolerance = False
    recompiles = copies["resident"].blocks.graphs_compiled() - before
    compiled_s = steps_s({**timed, "streamed_fp8": copies["streamed_fp8"]}, served, args.repeats)
    bound = bytes_bound_s(args, copies, served) if args.device.type == "cuda" else None
    return {"bound_s": bound, "served": served, "warm": warm, "eager_s": eager_s, "compiled_s": compiled_s, "recompiles": recompiles,
            "bitwise": equal, "tolerance": tolerance}


def bytes_bound_s(args, copies: dict[str, Copy], served) -> dict:
    """Per shape and streamed copy: the bytes one step streams over the link's pinned rate (GPU only)."""
    from offload_core.streaming.link import measure_link

    rate = measure_link(args.device).pinned_Bps
    bounds = {}
    for key in ("streamed", "streamed_fp8"):
        streamer = copies[key].streamer
        streamer.reset_counters()
        copies[key].run(served[0])
        bounds[key] = streamer.bytes_copied / rate
    return bounds


def cache_probe(args) -> float:
    """One fresh process's compile seconds for the tiny Wan's bucket with ``args.cache_dir`` as inductor's cache."""
    args.model, args.repeats = "tiny-wan", 1
    copy = Copy(args, load("tiny-wan", args.dtype, None))
    copy.blocks = apply_block_compile(copy.model, CompileConfig(buckets=(ShapeBucket("all", SHAPES["tiny-wan"]),),
                                                               cache_dir=args.cache_dir))
    return warm_buckets(copy.blocks, copy.run)[0].compile_s


def probe_twice() -> tuple[float, float]:
    with tempfile.TemporaryDirectory(prefix="inductor-cache-") as folder:
        seconds = []
        for _ in range(2):
            done = subprocess.run([sys.executable, __file__, "--cache-probe", "--cache-dir", folder,
                                   "--threads", str(torch.get_num_threads())],
                                  capture_output=True, text=True, check=True)
            seconds.append(json.loads(done.stdout.strip().splitlines()[-1])["compile_s"])
        return seconds[0], seconds[1]


def report(args, m: dict) -> dict:
    served = m["served"]
    rows = [{"shape": str(s), "eager_resident_s": m["eager_s"]["resident"][s],
             "eager_streamed_s": m["eager_s"]["streamed"][s], "compiled_resident_s": m["compiled_s"]["resident"][s],
             "compiled_streamed_s": m["compiled_s"]["streamed"][s]} for s in served]
    for row in rows:
        shape = next(s for s in served if str(s) == row["shape"])
        row["compiled_streamed_fp8_s"] = m["compiled_s"]["streamed_fp8"][shape]
        if m["bound_s"] is not None:  # the GPU target: <= 1.05 x max(compiled resident, bytes / rate)
            row["compiled_streamed_over_bound"] = row["compiled_streamed_s"] / max(
                row["compiled_resident_s"], m["bound_s"]["streamed"])
            row["compiled_streamed_fp8_over_bound"] = row["compiled_streamed_fp8_s"] / max(
                row["compiled_resident_s"], m["bound_s"]["streamed_fp8"])
        row["eager_over_compiled_resident"] = row["eager_resident_s"] / row["compiled_resident_s"]
        row["compiled_streamed_over_resident"] = row["compiled_streamed_s"] / row["compiled_resident_s"]
        # issue 33's FP8 target where launches no longer bind: FP8 over bf16, both streamed pinned and
        # compiled (the simulator projects 0.53 at 1 frame with the widen on its own stream, 0.71 without)
        row["compiled_fp8_over_native_streamed"] = row["compiled_streamed_fp8_s"] / row["compiled_streamed_s"]
        print(f"{args.model} {row['shape']}: eager resident {row['eager_resident_s'] * 1e3:.2f} ms, streamed "
              f"{row['eager_streamed_s'] * 1e3:.2f} ms; compiled resident {row['compiled_resident_s'] * 1e3:.2f} ms, "
              f"streamed {row['compiled_streamed_s'] * 1e3:.2f} ms; eager/compiled {row['eager_over_compiled_resident']:.2f}x, "
              f"compiled streamed/resident {row['compiled_streamed_over_resident']:.3f}x")
    warm = {key: [(w.bucket, round(w.compile_s, 2), w.graphs) for w in figures] for key, figures in m["warm"].items()}
    print(f"warm-up (bucket, compile s, graphs): {warm}")
    fields = {"model": args.model, "device": str(args.device), "dtype": str(args.dtype).removeprefix("torch."),
              "shapes": [str(s) for s in served], "rows": rows, "warmup": warm,
              "compile_s_first_bucket": m["warm"]["resident"][0].compile_s,
              "recompiles_after_warmup": int(m["recompiles"]),
              "streamed_bitwise_equal_resident_compiled": bool(m["bitwise"]),
              "compiled_within_tolerance_of_eager": bool(m["tolerance"]),
              "eager_over_compiled_resident": min(r["eager_over_compiled_resident"] for r in rows),
              "compiled_streamed_over_resident_max": max(r["compiled_streamed_over_resident"] for r in rows),
              "compiled_fp8_over_native_streamed": {r["shape"]: round(r["compiled_fp8_over_native_streamed"], 3)
                                                    for r in rows}}
    if m["bound_s"] is not None:
        fields["compiled_streamed_over_bound_max"] = max(r["compiled_streamed_over_bound"] for r in rows)
    return fields


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="5 repeats per step")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--model", choices=sorted(SHAPES), action="append", default=None,
                        help="repeatable; default: tiny-wan and tiny-flux (cpu), wan2.1-1.3b and flux-sized (cuda)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                        help="default: float32 on cpu, bfloat16 on cuda")
    parser.add_argument("--blocks", type=int, default=None,
                        help="cap the real-size models' blocks (flux-sized: N double + 2N single, default 6)")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads (CPU default 1: inductor's OpenMP kernels spin-wait on a shared 2-core VM)")
    parser.add_argument("--cache-dir", default=None, help="inductor's cache dir (default: torch's)")
    parser.add_argument("--cache-probe", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--no-cache-probe", action="store_true")
    args = parser.parse_args()
    args.device = torch.device(args.device)
    args.dtype = getattr(torch, args.dtype or ("float32" if args.device.type == "cpu" else "bfloat16"))
    args.repeats = args.repeats or (5 if args.quick else 15)
    if args.threads or args.device.type == "cpu":
        torch.set_num_threads(args.threads or 1)  # before any compile: inductor's CPU kernels take the count then
    if args.cache_probe:
        print(json.dumps({"compile_s": cache_probe(args)}))
        return 0
    models = args.model or (["tiny-wan", "tiny-flux"] if args.device.type == "cpu" else ["wan2.1-1.3b", "flux-sized"])
    results = []
    for name in models:
        args.model = name
        results.append(report(args, measure(args)))
    probe = None if args.no_cache_probe or args.device.type != "cpu" else probe_twice()
    fields = {"models": results,
              "recompiles_after_warmup": sum(r["recompiles_after_warmup"] for r in results),
              "streamed_bitwise_equal_resident_compiled": all(r["streamed_bitwise_equal_resident_compiled"]
                                                              for r in results),
              "compiled_within_tolerance_of_eager": all(r["compiled_within_tolerance_of_eager"] for r in results)}
    if probe is not None:
        fields["cache_cold_compile_s"], fields["cache_warm_compile_s"] = probe
        print(f"restart: tiny Wan bucket compiled in {probe[0]:.2f} s by a fresh process with an empty inductor "
              f"cache dir, {probe[1]:.2f} s by the next one")
    targets = [checks.at_most(f"{r['model']}_compiled_streamed_over_bound", r["compiled_streamed_over_bound_max"], 1.05)
               for r in results if "compiled_streamed_over_bound_max" in r]
    return checks.finish(fields, [
        *targets,
        checks.equal("recompiles_after_warmup", fields["recompiles_after_warmup"], 0),
        checks.equal("streamed_bitwise_equal_resident_compiled", fields["streamed_bitwise_equal_resident_compiled"], True),
        checks.equal("compiled_within_tolerance_of_eager", fields["compiled_within_tolerance_of_eager"], True)])


if __name__ == "__main__":
    sys.exit(main())
