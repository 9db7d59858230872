"""An edit's encode against its decode: the activation peak of the decoder stage's two calls.

The decoder stage leases a call's activations by its calibrated decode model (``StageWorker.run``), for
the decode and for an edit's encode (``families.condition``) alike, so the lease covers the encode only if
the encode's peak is at most the decode's at the same shape. This measures both (live tensor storage on the
CPU, ``measure_activations``) for Wan video edits (the source an mp4, decoded by ffmpeg in the call) and an
image family's edit, at a few shapes. Last line: one JSON object with the largest encode-over-decode ratio.

    OMP_NUM_THREADS=1 .venv/bin/python bench/edit_memory.py
"""
from __future__ import annotations

import argparse
import dataclasses
import io
import json
import sys
from pathlib import Path

import torch
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from deployments.models import activation_features, families  # noqa: E402
from deployments.wire import media  # noqa: E402
from deployments.wire.spec import GenerationSpec, PipelineStage  # noqa: E402
from offload_core.residency.activation_meter import measure_activations  # noqa: E402
from zoo import tiny  # noqa: E402

CPU, DECODE = torch.device("cpu"), PipelineStage.DECODE
# The medium Wan has the tiny one's VAE (the same peaks to the byte).
MODELS = {"tiny-wan": tiny.ensure_tiny_wan, "tiny-flux": tiny.ensure_tiny_flux}
SHAPES = {"full": ((64, 9), (128, 17), (128, 1)), "quick": ((32, 5),)}  # (side, frames)


def source(side: int, frames: int) -> dict:
    """The edit's source as the spec carries it: an mp4 for frames > 1, else a PNG."""
    pixels = torch.rand(frames, side, side, 3, generator=torch.Generator().manual_seed(0))
    if frames > 1:
        return {"reference_video": media.mp4_bytes(pixels, 8)}
    out = io.BytesIO()
    Image.fromarray(media.to_uint8(pixels[0])).save(out, format="PNG")
    return {"reference_image": out.getvalue()}


def measure(name: str, side: int, frames: int) -> dict:
    facts = families.read_family_traits(MODELS[name]())
    pipe = families.load_stage_pipeline(facts, DECODE, torch.float32)
    modules = families.stage_modules(pipe, facts, DECODE)
    weights = [t for m in modules.values() for t in (*m.parameters(), *m.buffers())]
    plain = GenerationSpec("m", "a red fox", None, side, side, frames, 4, 1.0, 1, 1)
    edit = dataclasses.replace(plain, strength=0.6, edit_rule=facts.edit_rule, **source(side, frames))
    latents = activation_features.stage_input(pipe, facts, DECODE, plain)
    with torch.no_grad():
        _, encode = measure_activations(lambda: families.condition(pipe, facts, edit, CPU), CPU, weights)
        _, decode = measure_activations(lambda: families.decode(pipe, facts, latents, plain, CPU), CPU, weights)
    return {"model": name, "size": f"{side}x{side}", "frames": frames, "encode_peak_bytes": encode.peak_bytes,
            "decode_peak_bytes": decode.peak_bytes, "encode_over_decode": round(encode.peak_bytes / decode.peak_bytes, 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one small shape per model (the test's)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = []
    for name in MODELS:
        video = families.read_family_traits(MODELS[name]()).supports_video
        for side, frames in SHAPES["quick" if args.quick else "full"]:
            if frames > 1 and not video:
                continue
            rows.append(measure(name, side, frames))
            r = rows[-1]
            print(f"{name:10} {r['size']:8} {frames:3} frames: encode {r['encode_peak_bytes']:>11,} B, decode "
                  f"{r['decode_peak_bytes']:>11,} B: {r['encode_over_decode']}")
    print(json.dumps({"bench": "edit_memory", "rows": rows,
                      "max_encode_over_decode": max(r["encode_over_decode"] for r in rows)}))


if __name__ == "__main__":
    main()
