"""Activation prediction on a GPU: calibrate each stage on two shapes, predict a held-out third.

The service calibrates every stage replica's activation model at start-up on its own device
(``deployments/models/activation_features.py``); on CPU the tests pin the prediction within 10 % of the measured
peak (live tensor storage). A CPU calibration is not a CUDA one: this prints the same comparison
with CUDA's ``max_memory_allocated`` for every zoo model and stage, stages loaded on the GPU.

    python bench/gpu_activations.py        # on a CUDA machine; on CPU it runs the CPU comparison
Last line: one JSON object with ``max_abs_error`` (a fraction of the measured peak).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from deployments.models import (
    activation_features,  # noqa: E402
    families,  # noqa: E402
)
from deployments.wire.spec import GenerationSpec, PipelineStage  # noqa: E402
from offload_core.residency.activation_meter import measure_activations  # noqa: E402
from zoo import tiny  # noqa: E402

ZOO = {"tiny-wan": tiny.ensure_tiny_wan, "medium-wan": tiny.ensure_medium_wan, "tiny-flux": tiny.ensure_tiny_flux}


def held_out(facts, regime: activation_features.Regime) -> GenerationSpec:
    frames = 1 if regime is activation_features.Regime.IMAGE else 1 + 2 * facts.temporal_factor
    n = 1 if regime is activation_features.Regime.IMAGE else 2
    return GenerationSpec("held-out", "a held-out shape", None, 32, 48, frames, 1, facts.default_guidance, 0, n)


def compare(model: str, device: torch.device) -> list[dict]:
    facts = families.read_family_traits(ZOO[model]())
    rows = []
    for stage in PipelineStage:
        pipe = families.load_stage_pipeline(facts, stage, torch.float32)
        modules = families.stage_modules(pipe, facts, stage)
        for module in modules.values():
            module.to(device)
        weights = [t for m in modules.values() for t in (*m.parameters(), *m.buffers())]

        seen: list[tuple[str, int]] = []  # every call's peak, the unmeasured warm-up calls included

        def measure(spec: GenerationSpec) -> int:
            value = activation_features.stage_input(pipe, facts, stage, spec)
            _, m = measure_activations(lambda: activation_features.run_stage(pipe, facts, stage, spec, device, value),
                                       device, weights)
            seen.append((spec.request_id, m.peak_bytes))
            return m.peak_bytes

        shapes = activation_features.calibration_shapes(facts)
        fitted = activation_features.calibrate_stage(facts, stage, shapes, measure, 4)
        for regime in sorted({activation_features.regime(s) for s in shapes}, key=lambda r: r.value):
            spec = held_out(facts, regime)
            measured, predicted = measure(spec), fitted.predict(spec)
            rows.append({"model": model, "stage": stage.value, "regime": regime.value, "measured_bytes": measured,
                         "predicted_bytes": predicted, "error": round((predicted - measured) / measured, 4),
                         "model_fit": fitted.models[regime].explain(), "calls": [list(c) for c in seen]})
        if device.type == "cuda":  # this stage's blocks go before the next stage loads
            torch.cuda.empty_cache()
    return rows


def main() -> None:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rows = [row for model in ZOO for row in compare(model, device)]
    print(f"activation prediction on {device} (calibrated on 2 shapes per regime, held-out 48x32):")
    print(f"{'model':11} {'stage':8} {'regime':6} {'measured B':>12} {'predicted B':>12} {'error':>7}")
    for r in rows:
        print(f"{r['model']:11} {r['stage']:8} {r['regime']:6} {r['measured_bytes']:>12,} "
              f"{r['predicted_bytes']:>12,} {r['error']:>+7.2%}")
    print(json.dumps({"bench": "gpu_activations", "device": str(device), "rows": rows,
                      "max_abs_error": max(abs(r["error"]) for r in rows)}))


if __name__ == "__main__":
    main()
