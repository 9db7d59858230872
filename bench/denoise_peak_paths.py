"""A guided request's Denoiser activation peak on the two paths a replica could calibrate on.

The Denoiser runs every request through its family's stepper (a step batch of one when alone): guidance's two
branches in one forward of twice the rows. The pipelines' own loop runs them as two forwards on Wan, Qwen-Image
and HunyuanVideo 1.5 (SD3.5's pipeline joins them too). A replica that calibrates its activation model on the
pipeline's loop predicts a guided request at the smaller peak, and admission overcommits the GPU by the ratio
printed here. ``activation_features.denoise_as_served`` is the stepper's path, what the warm-up calibrates on.
Live tensor storage on the CPU (``measure_activations``), tiny zoo, a guided default request (a negative prompt
"" where the family takes one). Last line: one JSON object with the ratios.

    OMP_NUM_THREADS=1 .venv/bin/python bench/denoise_peak_paths.py
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from deployments.models import activation_features, families  # noqa: E402
from deployments.wire.spec import GenerationSpec, PipelineStage  # noqa: E402
from offload_core.residency.activation_meter import measure_activations  # noqa: E402
from zoo import tiny, tiny_families  # noqa: E402

CPU, DENOISE = torch.device("cpu"), PipelineStage.DENOISE
MODELS = {"tiny-wan": tiny.ensure_tiny_wan, "tiny-sd3": tiny_families.ensure_tiny_sd3,
          "tiny-qwen-image": tiny_families.ensure_tiny_qwen_image, "tiny-hunyuan15": tiny_families.ensure_tiny_hunyuan15}


def peaks(name: str, folder: Path) -> list[dict]:
    facts = families.read_family_traits(folder)
    pipe = families.load_stage_pipeline(facts, DENOISE, torch.float32)
    weights = [t for m in families.stage_modules(pipe, facts, DENOISE).values() for t in (*m.parameters(), *m.buffers())]
    rows = []
    for side in (4 * facts.size_multiple, 8 * facts.size_multiple):
        frames = 1 + facts.temporal_factor if facts.supports_video else 1
        spec = GenerationSpec(f"{name}-{side}", "warm-up", "", side, side, frames, facts.min_steps,
                              facts.default_guidance, 0, 1)
        value = activation_features.stage_input(pipe, facts, DENOISE, spec)
        _, loop = measure_activations(lambda: families.denoise(pipe, facts, value, spec, CPU), CPU, weights)
        _, served = measure_activations(
            lambda: activation_features.denoise_as_served(pipe, facts, value, spec, CPU), CPU, weights)
        rows.append({"model": name, "side": side, "frames": frames, "pipeline_loop_peak_B": loop.peak_bytes,
                     "step_batcher_peak_B": served.peak_bytes,
                     "served_over_loop": round(served.peak_bytes / loop.peak_bytes, 3)})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def main() -> None:
    torch.manual_seed(0)
    rows = [row for name, build in MODELS.items() for row in peaks(name, build())]
    print(json.dumps({"rows": rows, "served_over_loop": {r["model"] + f"@{r['side']}": r["served_over_loop"]
                                                         for r in rows}}))


if __name__ == "__main__":
    main()
