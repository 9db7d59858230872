"""What an edit costs against a generation of the same size: its image's (or video's) encode, then fewer steps.

In-process, one CPU thread, the stages' own code: the decoder stage's ``families.condition`` (the VAE
encodes the image), the family's stepper through the step batcher (``StepBatch``) entered at the edit's
first step (``begin_edit``), then ``families.decode``; a generation is the same without the first and
with every step. A tiny zoo image family (``--family``; the zoo has no medium image model), its
default guidance; strengths 0.25, 0.6 and 1.0 beside a generation, interleaved so the machine's load
hits them alike; medians of the repetitions. Each strength's image is checked bitwise against the
family's diffusers img2img pipeline once. ``--family wan`` / ``medium-wan``: a video edit (a remix) of
``--frames`` frames, unguided, the source an mp4 the decoder stage decodes with ffmpeg (in its encode
time), checked bitwise against ``WanVideoToVideoPipeline``. Last line: one JSON object.

    OMP_NUM_THREADS=1 .venv/bin/python bench/edits.py --family sd3
    OMP_NUM_THREADS=1 .venv/bin/python bench/edits.py --family medium-wan --frames 9
"""
from __future__ import annotations

import argparse
import dataclasses
import io
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from deployments.models import families  # noqa: E402
from deployments.models.registry import adapter_for  # noqa: E402
from deployments.replica.batching import BatchingConfig, StepBatch  # noqa: E402
from deployments.wire.spec import GenerationSpec, PipelineStage  # noqa: E402
from zoo import tiny, tiny_families  # noqa: E402

CPU = torch.device("cpu")
FOLDERS = {"flux": tiny.ensure_tiny_flux, "sd3": tiny_families.ensure_tiny_sd3,
           "z-image": tiny_families.ensure_tiny_zimage, "qwen-image": tiny_families.ensure_tiny_qwen_image,
           "wan": tiny.ensure_tiny_wan, "medium-wan": tiny.ensure_medium_wan}
VIDEO_FAMILIES = {"wan", "medium-wan"}
STRENGTHS = (0.25, 0.6, 1.0)


def photo(side: int) -> bytes:
    image = Image.new("RGB", (side, side))
    image.putdata([(x % 256, y % 256, 128) for y in range(side) for x in range(side)])
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def clip(frames: int, side: int) -> bytes:
    """A video edit's source: frames with structure (a gradient, a square that moves), as an mp4."""
    from deployments.wire import media

    y, x = torch.meshgrid(torch.arange(side), torch.arange(side), indexing="ij")
    video = torch.stack([x / side, y / side, torch.full((side, side), 0.5)], dim=-1).repeat(frames, 1, 1, 1)
    for f in range(frames):
        video[f, side // 4:side // 2, f * side // (2 * frames):f * side // (2 * frames) + side // 4] = 0.9
    return media.mp4_bytes(video, 8)


def edit_specs(base: GenerationSpec, facts, video: bool) -> dict:
    """The generation (None) and an edit of the same shape per strength."""
    source = {"reference_video": clip(base.num_frames, base.width)} if video else {"reference_image": photo(base.width)}
    return {None: base} | {s: dataclasses.replace(base, strength=s, edit_rule=facts.edit_rule, **source)
                           for s in STRENGTHS}


def one_request(pipes, facts, stepper, encoded, spec: GenerationSpec) -> tuple[float, float, float, torch.Tensor]:
    """(seconds to encode the image, to denoise, to decode; the frames) for ``spec``."""
    start = time.perf_counter()
    source = families.condition(pipes[PipelineStage.DECODE], facts, spec, CPU) if spec.strength else None
    encoded_at = time.perf_counter()
    request = stepper.start(encoded, spec)
    if source is not None:
        stepper.begin_edit(request, source)
    batch = StepBatch(stepper, BatchingConfig(max_batch=1))
    future = batch.submit(request)
    while not batch.idle:
        batch.step()
    latents = future.result()
    denoised_at = time.perf_counter()
    frames = families.decode(pipes[PipelineStage.DECODE], facts, latents, spec, CPU)
    return encoded_at - start, denoised_at - encoded_at, time.perf_counter() - denoised_at, frames


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", choices=sorted(FOLDERS), default="sd3")
    parser.add_argument("--side", type=int, default=128)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--frames", type=int, default=9, help="a video edit's frames (--family wan, medium-wan)")
    args = parser.parse_args()
    torch.set_num_threads(1)  # as Ray runs a replica actor that asks for no CPUs
    facts = families.read_family_traits(FOLDERS[args.family]())
    pipes = {s: families.load_stage_pipeline(facts, s, torch.float32) for s in PipelineStage}
    video = args.family in VIDEO_FAMILIES
    # A video edit unguided: WanVideoToVideoPipeline's two guided forwards are the step batch's one within a level.
    base = GenerationSpec("bench", "a red fox", None, args.side, args.side, args.frames if video else 1, args.steps,
                          1.0 if video else facts.default_guidance, 1, 1)
    encoded = families.encode(pipes[PipelineStage.ENCODE], facts, base, CPU).packed().unpacked()
    stepper = adapter_for(facts).stepper(pipes[PipelineStage.DENOISE], facts, CPU)
    kinds = edit_specs(base, facts, video)
    runs = {k: [] for k in kinds}
    with torch.no_grad():
        for _ in range(args.reps):
            for k, spec in kinds.items():
                runs[k].append(one_request(pipes, facts, stepper, encoded, spec))
        full = families.load_full_pipeline(facts, torch.float32)
        bitwise = all(torch.equal(runs[s][0][3], families.reference_frames(full, facts, kinds[s])) for s in STRENGTHS)
    rows = []
    for k, measured in runs.items():
        encode_s, denoise_s, decode_s = (statistics.median(r[i] for r in measured) for i in range(3))
        rows.append({"strength": k, "steps_run": kinds[k].run_steps, "encode_s": round(encode_s, 4),
                     "denoise_s": round(denoise_s, 4), "decode_s": round(decode_s, 4),
                     "request_s": round(encode_s + denoise_s + decode_s, 4)})
        print(f"{'generation' if k is None else f'edit at strength {k}'}: {kinds[k].run_steps} steps, encode "
              f"{encode_s:.4f} s, denoise {denoise_s:.4f} s, decode {decode_s:.4f} s")
    generation = rows[0]
    summary = {"family": args.family, "model": Path(facts.folder).name, "size": f"{args.side}x{args.side}",
               "frames": base.num_frames, "guidance": base.guidance_scale, "steps": args.steps, "reps": args.reps,
               "rows": rows,
               # The whole request (encode + denoise + decode) of an edit over a generation's.
               "request_over_generation": {r["strength"]: round(r["request_s"] / generation["request_s"], 4)
                                           for r in rows[1:]},
               # The Denoiser's time per step run, edit over generation: 1 if entering late costs nothing.
               "per_step_over_generation": {r["strength"]: round(r["denoise_s"] / r["steps_run"]
                                                                 / (generation["denoise_s"] / args.steps), 4)
                                            for r in rows[1:]},
               # The decoder's encode of the image (a video: its ffmpeg decode too), in decodes of the same size.
               "encode_over_decode": round(statistics.median(r["encode_s"] for r in rows[1:]) / generation["decode_s"], 4),
               "bitwise_img2img_pipeline": bitwise}
    print(json.dumps(summary))
    sys.exit(0 if bitwise else 1)


if __name__ == "__main__":
    main()
