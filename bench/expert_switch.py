"""Expert-switch cost in straddling step batches (Wan2.2 A14B): a batch whose requests sit on different
experts runs two forwards per step, one per expert, against one forward for a batch on one expert.

The tiny two-expert Wan (``zoo.wan22``), both experts streamed layer by layer at depth 1 (as the L4 plan
streams them), one CPU thread. For each batch size, requests are placed at a high-noise step
(``transformer``), a low-noise step (``transformer_2``), or half and half (straddling), and one step's
``stepper.forward`` is timed (the median of the repetitions; all three placements interleaved, so the
machine's load hits them alike) and its streamed bytes counted. Ratios: straddling over the mean of
the two one-expert placements. Last line: one JSON object.

    .venv/bin/python bench/expert_switch.py --quick
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from deployments.models import families  # noqa: E402
from deployments.models.wan import expert_for  # noqa: E402
from deployments.wire.spec import GenerationSpec, PipelineStage  # noqa: E402
from offload_core import StreamingConfig, apply_layer_streaming  # noqa: E402
from zoo.wan22 import ensure_tiny_wan22_a14b  # noqa: E402

CPU = torch.device("cpu")
PLACEMENTS = ("high", "low", "straddling")


def placed(stepper, encoded, spec: GenerationSpec, step: int):
    """A request whose next step is ``step`` (its scheduler untouched: only forwards are timed)."""
    request = stepper.start(encoded, spec)
    request.step = step
    return request


def measure(stepper, streamers, batches: dict, reps: int) -> dict:
    seconds = {p: [] for p in batches}
    copied = {p: 0 for p in batches}
    with torch.no_grad():
        for _ in range(reps):
            for placement, batch in batches.items():
                before = sum(s.bytes_copied for s in streamers)
                start = time.perf_counter()
                stepper.forward(batch)
                seconds[placement].append(time.perf_counter() - start)
                copied[placement] += sum(s.bytes_copied for s in streamers) - before
    return {p: {"s_per_step": statistics.median(seconds[p]), "bytes_per_step": copied[p] // reps} for p in batches}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="32x32, 5 frames, 15 repetitions")
    args = parser.parse_args()
    side, frames, reps = (32, 5, 15) if args.quick else (64, 9, 30)
    torch.set_num_threads(1)
    facts = families.read_family_traits(ensure_tiny_wan22_a14b())
    steps = 8
    spec = GenerationSpec("e", "a red fox", "blurry", side, side, frames, steps, 5.0, 0, 1)
    encoded = families.encode(families.load_stage_pipeline(facts, PipelineStage.ENCODE, torch.float32), facts,
                              spec, CPU)
    pipe = families.load_stage_pipeline(facts, PipelineStage.DENOISE, torch.float32)
    for name in facts.experts:  # own allocations, as on a device (from_pretrained leaves file-mapping views)
        for param in getattr(pipe, name).parameters():
            param.data = param.data.clone()
    streamers = [apply_layer_streaming(getattr(pipe, n), CPU, StreamingConfig(prefetch_depth=1)) for n in facts.experts]
    stepper = families.adapter_for(facts).stepper(pipe, facts, CPU)
    timesteps = stepper.start(encoded, spec).timesteps
    low = next(i for i, t in enumerate(timesteps) if expert_for(pipe, t) == "transformer_2")
    rows = []
    try:
        for size in (2, 4):
            def at(step, i):
                return placed(stepper, encoded, GenerationSpec(f"r{i}", "a red fox", "blurry", side, side, frames,
                                                               steps, 5.0, i, 1), step)
            batches = {"high": [at(0, i) for i in range(size)], "low": [at(low, i) for i in range(size)],
                       "straddling": [at(0 if i < size // 2 else low, i) for i in range(size)]}
            figures = measure(stepper, streamers, batches, reps)
            one = {k: (figures["high"][k] + figures["low"][k]) / 2 for k in ("s_per_step", "bytes_per_step")}
            row = {"batch": size, **{f"{p}_s_per_step": round(figures[p]["s_per_step"], 5) for p in PLACEMENTS},
                   **{f"{p}_bytes_per_step": figures[p]["bytes_per_step"] for p in PLACEMENTS},
                   "time_ratio": round(figures["straddling"]["s_per_step"] / one["s_per_step"], 3),
                   "bytes_ratio": round(figures["straddling"]["bytes_per_step"] / one["bytes_per_step"], 3)}
            rows.append(row)
            print(f"batch {size}: one step high {row['high_s_per_step'] * 1e3:.2f} ms, low "
                  f"{row['low_s_per_step'] * 1e3:.2f} ms, straddling {row['straddling_s_per_step'] * 1e3:.2f} ms "
                  f"(x{row['time_ratio']}); streamed {row['straddling_bytes_per_step']} B against "
                  f"{row['high_bytes_per_step']} B (x{row['bytes_ratio']})")
    finally:
        for streamer in streamers:
            streamer.remove()
    print(json.dumps({"shape": f"{side}x{side}x{frames}", "low_noise_step": low, "steps": steps,
                      "forwards_by_expert": stepper.forwards_by_expert, "load_average": round(os.getloadavg()[0], 2),
                      "rows": rows, "time_ratio_batch_4": rows[-1]["time_ratio"],
                      "bytes_ratio_batch_4": rows[-1]["bytes_ratio"]}))


if __name__ == "__main__":
    main()
