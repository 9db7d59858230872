"""A guided request's Denoiser peak against the activation model's prediction, by prompt length (tiny zoo).

Qwen-Image pads no prompt, so a forward carries the prompt's own tokens (up to 512; an edit's also hold its
images' vision tokens). The replica calibrates on a 64-token stand-in. Per prompt length this prints the
served peak (a step batch of one, live tensor storage on the CPU) over the prediction at the stand-in's count
(what the Denoiser leased until 708192f) and at the encoder's count (``spec.text_tokens``, what it leases now).
Last line: one JSON object with every row.

    OMP_NUM_THREADS=1 .venv/bin/python bench/prompt_length_peaks.py
"""
from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from deployments.models import activation_features, families  # noqa: E402
from deployments.models.registry import adapter_for  # noqa: E402
from deployments.wire.spec import GenerationSpec, PipelineStage  # noqa: E402
from offload_core.residency.activation_meter import measure_activations  # noqa: E402
from tests.deployments.models.in_context import a_photo, through_a_step_batch  # noqa: E402
from zoo import tiny_families  # noqa: E402

CPU, ENCODE, DENOISE, DECODE = torch.device("cpu"), PipelineStage.ENCODE, PipelineStage.DENOISE, PipelineStage.DECODE
MODELS = {"tiny-qwen-image": (tiny_families.ensure_tiny_qwen_image, False),
          "tiny-qwen-image-edit": (tiny_families.ensure_tiny_qwen_image_edit, True)}


def served_peak(stepper, encoded, spec, weights) -> int:
    return measure_activations(lambda: through_a_step_batch(stepper, stepper.start(encoded, spec)), CPU, weights)[1].peak_bytes


def rows(name: str, folder: Path, edit: bool) -> list[dict]:
    facts = families.read_family_traits(folder)
    pipes = {s: families.load_stage_pipeline(facts, s, torch.float32) for s in PipelineStage}
    weights = [t for m in families.stage_modules(pipes[DENOISE], facts, DENOISE).values()
               for t in (*m.parameters(), *m.buffers())]

    def measure(spec):
        value = activation_features.stage_input(pipes[DENOISE], facts, DENOISE, spec)
        return measure_activations(lambda: activation_features.run_stage(pipes[DENOISE], facts, DENOISE, spec, CPU,
                                                                         value), CPU, weights)[1].peak_bytes

    fitted = activation_features.calibrate_stage(
        facts, DENOISE, activation_features.calibration_shapes(facts, stage=DENOISE), measure, 4)
    out = []
    for words in (1, 10, 40, 120):
        spec = GenerationSpec("long", " ".join(["a fox in the snow"] * words), "", 32, 48, 1, facts.min_steps,
                              facts.default_guidance, 0, 1, a_photo(60, 40) if edit else None)
        encoded = families.encode(pipes[ENCODE], facts, spec, CPU)
        if edit:
            encoded = dataclasses.replace(encoded, image_condition=families.condition(pipes[DECODE], facts, spec, CPU))
        adapter = adapter_for(facts)
        counted = dataclasses.replace(spec, text_tokens=adapter.encoded_text_tokens(encoded))
        peak = served_peak(adapter.stepper(pipes[DENOISE], facts, CPU), encoded, counted, weights)
        out.append({"model": name, "prompt_words": 5 * words, "text_tokens": counted.text_tokens, "peak_B": peak,
                    "stand_in_prediction_over_peak": round(fitted.predict(spec) / peak, 3),
                    "counted_prediction_over_peak": round(fitted.predict(counted) / peak, 3)})
        print(json.dumps(out[-1]), flush=True)
    return out


def main() -> None:
    torch.manual_seed(0)
    found = [r for name, (build, edit) in MODELS.items() for r in rows(name, build(), edit)]
    print(json.dumps({"rows": found}))


if __name__ == "__main__":
    main()
