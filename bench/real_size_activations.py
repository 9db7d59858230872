"""Every real model's Denoiser forward and VAE decode at its published default request, measured on meta.

What the planner keeps free of weights (offload_core/planner/meta_activations.py): the larger of the two, 15 %
over, at least 3 GiB. Each call is measured now (the library imported, the component built on meta), and
beside it the figure committed in configs/models/real_model_activations.json, which planning reads. With
``--vae-tiling`` each model's VAE decode is measured once more with diffusers' ``vae.enable_tiling()`` (the
service does not tile; 1-2 min a video model on meta). Last line: one JSON object with every row.

    OMP_NUM_THREADS=1 .venv/bin/python bench/real_size_activations.py [--vae-tiling]
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from offload_core.planner import meta_activations as activations  # noqa: E402
from offload_core.planner import real_models  # noqa: E402
from offload_core.planner.activation_model import ACTIVATION_MARGIN  # noqa: E402
from offload_core.planner.inputs import WORKING_SET_FLOOR  # noqa: E402

GiB = 2**30


def tiled_decode_GiB(load: dict, request) -> float | None:
    """The VAE's decode at ``request`` with its tiling on, on meta; None for a VAE without tiling."""
    class_name, config, dtype, _ = load["vae"]
    vae = real_models.build_meta(class_name, config, dtype)
    latents = activations.decode_latents(class_name, config, request, dtype)
    if latents is None or not hasattr(vae, "enable_tiling"):
        return None
    vae.enable_tiling()
    return round(activations.peak_of(lambda: vae.decode(latents, return_dict=False), vae) / GiB, 2)


def row(model: str, tiling: bool) -> dict:
    load = {c: (s.class_name, s.config, s.dtype, s.layer_groups) for c in real_models.component_names(model)
            for s in [real_models.component_spec(model, c)]}
    pipeline = real_models.pipeline_class(model)
    request = activations.planned_request(pipeline, load, real_models.pipeline_defaults(model))
    out = {"model": model, "request": request.describe()}
    for call in activations.Call:
        class_name, config, dtype, _ = load[call.component]
        start = time.perf_counter()
        now = activations.measure(call, pipeline, class_name, config, dtype, request)
        committed = activations.planned_peak(call, pipeline, class_name, config, dtype, request)
        out[call.value] = {"GiB": None if now.bytes is None else round(now.bytes / GiB, 2), "why": now.why,
                           "seconds": round(time.perf_counter() - start, 2),
                           "committed_is_current": committed.bytes == now.bytes}
    if tiling:
        out["decode"]["tiled_GiB"] = tiled_decode_GiB(load, request)
    largest = max((out[c.value]["GiB"] or 0.0) for c in activations.Call) * GiB
    out["working_set_GiB"] = round(max(WORKING_SET_FLOOR, math.ceil(ACTIVATION_MARGIN * largest)) / GiB, 2)
    print(json.dumps(out), flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vae-tiling", action="store_true", help="also measure each decode with the VAE's tiling on")
    tiling = parser.parse_args().vae_tiling
    rows = [row(model, tiling) for model in real_models.model_names()]
    print(json.dumps({"rows": rows, "working_set_GiB": {r["model"]: r["working_set_GiB"] for r in rows}}))


if __name__ == "__main__":
    main()
