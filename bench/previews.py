"""What ``partial_images`` costs a request: its denoise and decode with 0 previews against 1, 2 and 3.

In-process, one CPU thread, the Denoiser's and the decoder's own code: the family's stepper through the
step batcher (``StepBatch``), then ``families.decode``; with previews, each preview's latents (the
stepper's estimate, ``StepRequest.preview``) decoded as the ingress asks the VaeDecoder to. The
medium zoo Wan (``--quick``: the tiny one), an image of the asked size, the runs interleaved so the
machine's load hits them alike; the median of the repetitions. The final latents are checked
bitwise equal with and without previews. Last line: one JSON object.

    OMP_NUM_THREADS=1 .venv/bin/python bench/previews.py --quick
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from deployments.models import families  # noqa: E402
from deployments.models.registry import adapter_for  # noqa: E402
from deployments.replica.batching import BatchingConfig, StepBatch  # noqa: E402
from deployments.wire.spec import GenerationSpec, PipelineStage  # noqa: E402
from zoo.tiny import ensure_medium_wan, ensure_tiny_wan  # noqa: E402

CPU = torch.device("cpu")


def one_request(stepper, decoder, facts, encoded, spec: GenerationSpec) -> tuple[float, float, torch.Tensor]:
    """(seconds to denoise, seconds to decode previews and image, final latents) for ``spec``."""
    seen = []
    start = time.perf_counter()
    batch = StepBatch(stepper, BatchingConfig(max_batch=1))
    future = batch.submit(stepper.start(encoded, spec, on_step=seen.append))
    while not batch.idle:
        batch.step()
    latents = future.result()
    denoised = time.perf_counter()
    for progress in seen:
        if progress.preview is not None:
            families.decode(decoder, facts, progress.preview, spec, CPU)
    families.decode(decoder, facts, latents, spec, CPU)
    return denoised - start, time.perf_counter() - denoised, latents


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the tiny Wan, 64x64, 8 steps, 3 repetitions")
    parser.add_argument("--reps", type=int, default=None, help="default 3 (--quick) or 5")
    args = parser.parse_args()
    folder = ensure_tiny_wan() if args.quick else ensure_medium_wan()
    side, steps, reps = (64, 8, args.reps or 3) if args.quick else (256, 8, args.reps or 5)
    torch.set_num_threads(1)  # as Ray runs a replica actor that asks for no CPUs
    facts = families.read_family_traits(folder)
    pipes = {s: families.load_stage_pipeline(facts, s, torch.float32) for s in PipelineStage}
    base = GenerationSpec("bench", "a red fox", None, side, side, 1, steps, facts.default_guidance, 1, 1)
    encoded = families.encode(pipes[PipelineStage.ENCODE], facts, base, CPU).packed().unpacked()
    stepper = adapter_for(facts).stepper(pipes[PipelineStage.DENOISE], facts, CPU)
    runs = {k: [] for k in (0, 1, 2, 3)}
    with torch.no_grad():
        for _ in range(reps):
            for k in runs:
                spec = dataclasses.replace(base, partial_images=k)
                runs[k].append(one_request(stepper, pipes[PipelineStage.DECODE], facts, encoded, spec))
    plain = runs[0][0][2]
    assert all(torch.equal(r[2], plain) for rows in runs.values() for r in rows), "previews changed the image"
    rows = []
    for k, measured in runs.items():
        denoise_s = statistics.median(r[0] for r in measured)
        decode_s = statistics.median(r[1] for r in measured)
        rows.append({"partial_images": k, "denoise_s": round(denoise_s, 4), "decode_s": round(decode_s, 4),
                     "request_s": round(denoise_s + decode_s, 4)})
        print(f"partial_images {k}: denoise {denoise_s:.4f} s, decodes {decode_s:.4f} s, request "
              f"{denoise_s + decode_s:.4f} s")
    plain_denoise, one_decode = rows[0]["denoise_s"], rows[0]["decode_s"]
    summary = {"model": folder.name, "size": f"{side}x{side}", "steps": steps, "reps": reps, "rows": rows,
               # The Denoiser's side of a preview (the estimate and its copy to the host): within the
               # run-to-run spread of the step loop if it is as cheap as it should be.
               "denoise_over_plain": {r["partial_images"]: round(r["denoise_s"] / plain_denoise, 4) for r in rows},
               # The decoder's side: each preview one more decode of the image's size.
               "decodes_per_preview": {r["partial_images"]: round((r["decode_s"] - one_decode) / r["partial_images"]
                                                                  / one_decode, 4) for r in rows[1:]},
               "bitwise_same_image": True}
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
