"""Bytes over the link per image: bf16 vs FP8 host weights vs FP8 + step cache, at batch 1 and 4 clients.

Measured in process on CPU (the engine's copies are real, the copy counter exact): the Denoiser's
own stepper and step batching (``deployments.replica``), its transformer streamed at depth 1, in
bf16 (the real models' dtype; the tiny zoo is built fp32 and loaded as bf16 here). Four clients
are four requests submitted at the same boundary (one batch of 4). Per model:

- bytes streamed per image: bf16 baseline, FP8 (``weights: fp8``), FP8 + step cache at
  ``--threshold``, each at batch 1 and with 4 clients, and the cache's measured skip rate;
- FP8's difference from bf16 (reported, never asserted): relative L2 of one transformer output and
  PSNR of the decoded images (same prompt, seed, steps) on the tiny zoo.

Then a projection on the simulated accelerator for FLUX.1-dev at 512x512, 28 steps on an RTX 4090
and an L4 (``bench/batching_projection.py``'s stand-in model with the real layer bytes): images per
hour for each lever alone and combined. Skip rates and quality on the tiny random models are not
those of trained weights: the projection takes the cache's skip rate as a stated assumption.

    .venv/bin/python bench/link_bytes.py            # last line: one JSON object
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import batching_projection as bp  # noqa: E402
from deployments.models import families  # noqa: E402
from deployments.models.steppers import stepper_for  # noqa: E402
from deployments.replica.batching import BatchingConfig, StepBatch  # noqa: E402
from deployments.wire.spec import GenerationSpec, PipelineStage  # noqa: E402
from offload_core import StreamingConfig, WeightFormat, apply_layer_streaming  # noqa: E402
from offload_core.planner.facts import profile_component  # noqa: E402
from offload_core.planner.gpus import gpu_model  # noqa: E402
from offload_core.planner.inputs import SUSTAINED_FRACTION  # noqa: E402
from offload_core.planner.real_models import meta_component  # noqa: E402
from zoo.tiny import ensure_medium_wan, ensure_tiny_flux, ensure_tiny_wan  # noqa: E402

CPU, BF16 = torch.device("cpu"), torch.bfloat16
MODELS = {"tiny-wan": ensure_tiny_wan, "tiny-flux": ensure_tiny_flux, "medium-wan": ensure_medium_wan}
# Assumed for the projection, not measured here: ParaAttention and xDiT report ~2x on FLUX.1-dev with
# first-block caching at their default thresholds, i.e. about half the steps skipped; 0.4 errs low.
ASSUMED_SKIP_RATE = 0.4
# Device memory bandwidth, bytes/s (vendor figures), for the widen's cost in the projection: it reads
# 1 B and writes 2 B per weight element on the copy stream.
HBM_BPS = {"RTX4090": 1008e9, "L4": 300e9}


@dataclasses.dataclass(frozen=True)
class Run:
    bytes_per_image: float
    skip_rate: float


def _spec(i: int, steps: int, guided: bool, threshold: float) -> GenerationSpec:
    return GenerationSpec(f"r{i}", f"prompt number {i}", None, 32, 32, 1, steps, 5.0 if guided else 3.5, 10 + i, 1,
                          cache_threshold=threshold)


def _denoise(folder, weights: WeightFormat, threshold: float, clients: int, steps: int):
    """Bytes per image, skip rate, and the latents of request 0, for ``clients`` requests in one batch."""
    facts = families.read_family_traits(folder)
    encoder = families.load_stage_pipeline(facts, PipelineStage.ENCODE, BF16)
    denoiser = families.load_stage_pipeline(facts, PipelineStage.DENOISE, BF16)
    streamer = apply_layer_streaming(denoiser.transformer, CPU, StreamingConfig(prefetch_depth=1, weights=weights))
    try:
        stepper = stepper_for(denoiser, facts, CPU)
        batch = StepBatch(stepper, BatchingConfig(max_batch=clients))
        guided = facts.default_guidance > 1.0
        requests = []
        for i in range(clients):
            spec = _spec(i, steps, guided, threshold)
            request = stepper.start(families.encode(encoder, facts, spec, CPU), spec)
            request.cache.threshold = threshold
            requests.append((request, batch.submit(request)))
        while not batch.idle:
            batch.step()
        latents = requests[0][1].result()
        skipped = sum(r.cache.skipped for r, _ in requests)
        return streamer.bytes_copied / clients, skipped / (clients * steps), latents
    finally:
        streamer.remove()


def _psnr(a: torch.Tensor, b: torch.Tensor) -> float:
    mse = float(((a.float() - b.float()) ** 2).mean())
    return math.inf if mse == 0 else 10 * math.log10(1.0 / mse)


def _quality(folder, steps: int) -> dict:
    """FP8 vs bf16: relative L2 of one transformer forward, PSNR of the decoded images."""
    facts = families.read_family_traits(folder)
    _, _, native = _denoise(folder, WeightFormat.NATIVE, 0.0, 1, steps)
    _, _, fp8 = _denoise(folder, WeightFormat.FP8, 0.0, 1, steps)
    decoder = families.load_stage_pipeline(facts, PipelineStage.DECODE, torch.float32)
    spec = _spec(0, steps, facts.default_guidance > 1.0, 0.0)
    images = [families.decode(decoder, facts, latents.float(), spec, CPU) for latents in (native, fp8)]
    return {"latents_rel_l2": round(float((fp8.float() - native.float()).norm() / native.float().norm()), 5),
            "image_psnr_db": round(_psnr(*images), 2)}


def _forward_rel_l2(folder) -> float:
    """One transformer forward, FP8-streamed vs plain bf16, on the family's own first denoising input."""
    from offload_core.quant import fake_quantize_

    facts = families.read_family_traits(folder)
    outs = []
    for quantized in (False, True):
        denoiser = families.load_stage_pipeline(facts, PipelineStage.DENOISE, BF16)
        if quantized:
            fake_quantize_([b for g in ("blocks", "transformer_blocks", "single_transformer_blocks")
                            for b in getattr(denoiser.transformer, g, [])])
        encoder = families.load_stage_pipeline(facts, PipelineStage.ENCODE, BF16)
        spec = _spec(0, 1, facts.default_guidance > 1.0, 0.0)
        stepper = stepper_for(denoiser, facts, CPU)
        request = stepper.start(families.encode(encoder, facts, spec, CPU), spec)
        with torch.no_grad():
            outs.append(stepper.forward([request])[0].float())
    return round(float((outs[1] - outs[0]).norm() / outs[0].norm()), 5)


def measure(name: str, steps: int, threshold: float) -> dict:
    folder = MODELS[name]()
    out: dict = {"model": name, "steps": steps, "threshold": threshold}
    for label, weights, t in (("bf16", WeightFormat.NATIVE, 0.0), ("fp8", WeightFormat.FP8, 0.0),
                              ("fp8_cache", WeightFormat.FP8, threshold)):
        for clients in (1, 4):
            per_image, skip, _ = _denoise(folder, weights, t, clients, steps)
            out[f"{label}_bytes_per_image_c{clients}"] = round(per_image)
            if label == "fp8_cache":
                out[f"skip_rate_c{clients}"] = round(skip, 3)
    base = out["bf16_bytes_per_image_c1"]
    out["fp8_over_bf16"] = round(out["fp8_bytes_per_image_c1"] / base, 4)
    out["fp8_cache_over_bf16"] = round(out["fp8_cache_bytes_per_image_c1"] / base, 4)
    out["best_c4_over_bf16_c1"] = round(out["fp8_cache_bytes_per_image_c4"] / base, 4)
    if name.startswith("tiny"):
        out.update(_quality(folder, steps))
        out["transformer_rel_l2"] = _forward_rel_l2(folder)
    return out


# -- the projection ------------------------------------------------------------------------------

def _fp8_layer_bytes() -> list[int]:
    profile = profile_component("transformer", meta_component(bp.MODEL, "transformer"), uses_per_request=bp.STEPS,
                                weights=WeightFormat.FP8)
    return [layer.host_bytes for layer in profile.layers]


def project(skip_rate: float = ASSUMED_SKIP_RATE) -> dict:
    """Images per hour for FLUX.1-dev 512x512, 28 steps: bf16, FP8, cache, batching and all of them."""
    native_bytes, params, _ = bp.flux_layers()
    fp8_bytes = _fp8_layer_bytes()
    out = {"model": bp.MODEL, "steps": bp.STEPS, "assumed_skip_rate": skip_rate,
           "fp8_layer_bytes_over_bf16": round(sum(fp8_bytes) / sum(native_bytes), 4)}
    for gpu in ("RTX4090", "L4"):
        flops = gpu_model(gpu).dense_bf16_flops * SUSTAINED_FRACTION
        # Widening reads the 8-bit bytes and writes the bf16 ones on the device, on the copy stream.
        widen_s = sum(f + n for f, n in zip(fp8_bytes, native_bytes)) / HBM_BPS[gpu]
        rows = {}
        for batch in (1, 4):
            for label, layer_bytes in (("bf16", native_bytes), ("fp8", fp8_bytes)):
                step = bp.simulate_streamed(layer_bytes, params, batch, flops)
                step_s = step.step_s + (widen_s / len(native_bytes) if label == "fp8" else 0.0)
                # A skipped step: block 0's compute and copy, and depth (1) copies wasted.
                skip_s = max(step.compute_s / len(params), 2 * max(layer_bytes) / bp.PINNED_BPS)
                for cache in (False, True):
                    s = (1 - skip_rate) * step_s + skip_rate * skip_s if cache else step_s
                    key = f"{label}{'_cache' if cache else ''}_b{batch}"
                    rows[key] = {"step_s": round(s, 4), "images_per_hour": round(3600 * batch / (bp.STEPS * s), 1)}
        out[gpu] = rows
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threshold", type=float, default=0.1, help="the step cache threshold measured")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--models", default="tiny-wan,tiny-flux,medium-wan")
    args = parser.parse_args()
    torch.manual_seed(0)
    measured = {}
    for name in args.models.split(","):
        measured[name] = measure(name, args.steps, args.threshold)
        print(json.dumps(measured[name]))
    projection = project()
    for gpu in ("RTX4090", "L4"):
        print(f"{gpu}: " + ", ".join(f"{k} {v['images_per_hour']:.0f}/h" for k, v in projection[gpu].items()))
    head = measured.get("medium-wan") or next(iter(measured.values()))
    result = {"headline_model": head["model"], "threshold": args.threshold,
              "fp8_bytes_per_image_over_bf16": head["fp8_over_bf16"],
              "best_bytes_per_image_over_bf16_batch1": head["best_c4_over_bf16_c1"],
              "skip_rate": head["skip_rate_c1"], "skip_rate_4_clients": head["skip_rate_c4"],
              "models": measured, "projection": projection}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
