"""A tiling decoder's two-phase calibration on a real VAE at real size, on meta: what it measures, what it predicts.

The decoder replica's warm-up calibrates a tiled decode's two phases (deployments/models/tiled_activations.py) on
its own device. Here the same calibration runs on the real model's VAE built on meta (its published config,
bfloat16, random weights: nothing is allocated, every storage an op creates is counted), with the family's
traits taken from its tiny zoo folder (the same size multiple and temporal factor), and its predictions are
compared with the meta count of the VAE's tiled decode at real requests. The meta count is ``vae.decode``'s
alone: the service's post-processing after it is not in either figure. Last line: one JSON object.

    OMP_NUM_THREADS=1 .venv/bin/python bench/real_size_tiled_calibration.py [MODEL ...]   # minutes a model
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from deployments.models import activation_features, families, tiled_activations, vae_tiling  # noqa: E402
from deployments.wire.spec import GenerationSpec, PipelineStage  # noqa: E402
from offload_core.planner import meta_activations, real_models  # noqa: E402
from zoo import tiny, tiny_families  # noqa: E402

GiB = 2**30
# The real model, the tiny folder of its family (its traits), and real requests (width, height, frames).
MODELS = {
    "wan2.1-t2v-1.3b": (tiny.ensure_tiny_wan, [(832, 480, 81), (832, 480, 33), (1280, 720, 81), (1024, 1024, 1)]),
    "hunyuanvideo-1.5-480p-t2v": (tiny_families.ensure_tiny_hunyuan15,
                                  [(848, 480, 121), (832, 480, 33), (1280, 720, 121), (1024, 1024, 1)]),
}


def run(model: str) -> dict:
    folder, requests = MODELS[model]
    facts = families.read_family_traits(folder())
    spec = real_models.component_spec(model, "vae")
    vae = real_models.build_meta(spec.class_name, spec.config, spec.dtype)
    base = meta_activations.PlannedRequest(256, 256, 1, 1.0, 512, spec.config.get("scale_factor_spatial") or 8)
    visited = []

    def measure(asked: GenerationSpec) -> int:
        request = dataclasses.replace(base, height=asked.height, width=asked.width, frames=asked.num_frames)
        latents = meta_activations.decode_latents(spec.class_name, spec.config, request, spec.dtype)
        latents = latents.expand(asked.n, *latents.shape[1:])
        start = time.perf_counter()
        peak = meta_activations.peak_of(lambda: vae.decode(latents, return_dict=False), vae)
        visited.append({"shape": f"{asked.width}x{asked.height}x{asked.num_frames}", "n": asked.n,
                        "tile_px": vae_tiling.tile_side(vae), "GiB": round(peak / GiB, 3),
                        "seconds_on_meta": round(time.perf_counter() - start, 1)})
        return peak

    tile = vae_tiling.enable(vae, None)
    regimes = {activation_features.Regime.IMAGE, activation_features.Regime.VIDEO}
    models = tiled_activations.calibrate_tiled(facts, vae, regimes, measure, spec.dtype.itemsize)
    fitted = activation_features.StageActivations(facts, PipelineStage.DECODE, models, tile)
    rows = []
    for width, height, frames in requests:
        asked = GenerationSpec("real", "p", None, height, width, frames, 1, 5.0, 0, 1)
        counted, predicted = measure(asked), fitted.predict(asked)
        rows.append({"request": f"{width}x{height}x{frames}", "meta_GiB": round(counted / GiB, 2),
                     "predicted_GiB": round(predicted / GiB, 2), "predicted_over_meta": round(predicted / counted, 3)})
        print(model, json.dumps(rows[-1]), flush=True)
    return {"model": model, "vae": spec.class_name, "tile_px": tile, "fit": fitted.explain(),
            "calibration_shapes": visited[:-len(requests)], "rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="*", metavar="MODEL", help=f"of {list(MODELS)} (default: all)")
    models = parser.parse_args().models or list(MODELS)
    unknown = sorted(set(models) - set(MODELS))
    if unknown:
        parser.error(f"no such model {unknown}; choose from {list(MODELS)}")
    results = [run(model) for model in models]
    ratios = [r["predicted_over_meta"] for m in results for r in m["rows"]]
    print(json.dumps({"models": results, "predicted_over_meta_min": min(ratios), "predicted_over_meta_max": max(ratios)}))


if __name__ == "__main__":
    main()
