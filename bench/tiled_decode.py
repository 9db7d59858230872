"""Tiled VAE decoding on the tiny zoo: the peak it saves, the time it costs, and how well the decoder predicts it.

For one family per VAE class (Wan, AutoencoderKL, Qwen-Image, HunyuanVideo 1.5) the decoder's pipeline is tiled
at 64 px (AutoencoderKL at its own tile, its config's 32 px) and calibrated as its replica's warm-up does
(deployments/models/tiled_activations.py). Then, on held-out outputs from just beyond the tile to five tiles a
side: the measured peak against the prediction, and against the untiled decode's peak; and the decode's time,
tiled over untiled (median of 3, without the meter). Real-size figures are on meta:
``bench/real_size_activations.py --vae-tiling``. Last line: one JSON object.

    OMP_NUM_THREADS=1 .venv/bin/python bench/tiled_decode.py
"""
from __future__ import annotations

import json
import math
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from deployments.models import activation_features, families, vae_tiling  # noqa: E402
from tests.deployments.models.test_vae_tiling import CASES, calibrated_tiled_decoder  # noqa: E402

CPU = torch.device("cpu")


def _seconds(pipe, facts, spec) -> float:
    value = activation_features.stage_input(pipe, facts, activation_features.PipelineStage.DECODE, spec)
    times = []
    for _ in range(3):
        start = time.perf_counter()
        families.decode(pipe, facts, value, spec, CPU)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def case_rows(case) -> dict:
    facts = families.read_family_traits(case.folder())
    start = time.perf_counter()
    pipe, measure, fitted = calibrated_tiled_decoder(facts, case.tile_px)
    calibrated_s = time.perf_counter() - start
    tile, m = fitted.tile, facts.size_multiple
    frames = [1] + ([1 + 3 * facts.temporal_factor] if facts.supports_video else [])
    rows = []
    for f in frames:
        for side in (tile + m, math.ceil(1.6 * tile / m) * m, math.ceil(2.6 * tile / m) * m, 5 * tile):
            spec = activation_features.calibration_spec(facts, "held", side, f, 1, activation_features.PipelineStage.DECODE)
            predicted, tiled = fitted.predict(spec), measure(spec)
            tiled_s = _seconds(pipe, facts, spec)
            pipe.vae.disable_tiling()
            untiled, untiled_s = measure(spec), _seconds(pipe, facts, spec)
            vae_tiling.enable(pipe.vae, case.tile_px)
            row = {"shape": f"{side}x{side}x{f}", "tiled_peak_B": tiled, "predicted_over_peak": round(predicted / tiled, 3),
                   "tiled_over_untiled_peak": round(tiled / untiled, 3), "tiled_over_untiled_time": round(tiled_s / untiled_s, 2)}
            print(case.name, json.dumps(row), flush=True)
            rows.append(row)
    return {"family": case.name, "vae": type(pipe.vae).__name__, "tile_px": tile, "calibration_s": round(calibrated_s, 1),
            "rows": rows}


def main() -> None:
    results = [case_rows(case) for case in CASES]
    ratios = [r["predicted_over_peak"] for c in results for r in c["rows"]]
    print(json.dumps({"families": results, "predicted_over_peak_min": min(ratios), "predicted_over_peak_max": max(ratios)}))


if __name__ == "__main__":
    main()
