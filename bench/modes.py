"""Performance modes end to end on CPU: the tiny and medium Wan pipelines and the tiny Flux one.

For each pipeline: a warm-up on the plain pipeline measures uses and per-layer compute; the
planner plans every mode for a CPU "device" whose capacity is 1.5x the memory plan's peak (tight
enough that modes differ and the parking gates park); each mode then runs whole requests under
PipelineResidency. Printed per mode: measured peak device weight bytes and host->device bytes per
request, both as ratios to speed mode, request time vs speed mode, whether the output is bitwise
equal to the plain pipeline, and the planner's prediction error (target 0 on CPU).

    OMP_NUM_THREADS=1 .venv/bin/python bench/modes.py --quick     # < 40 s
The last line printed is one JSON object with every figure; an output not bitwise equal or a
prediction off by a byte exits 1 and is listed in its ``failed`` (``bench/checks.py``).
"""
from __future__ import annotations

import argparse
import gc
import logging
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import checks  # noqa: E402
from offload_core.planner.facts import LinkFacts, PipelineFacts, Stage  # noqa: E402
from offload_core.planner.measured_compute import profiles_from_warmup  # noqa: E402
from offload_core.planner.search import PerformanceMode, plan_pipeline  # noqa: E402
from offload_core.residency.compute_meter import measure_warmup  # noqa: E402
from offload_core.residency.lifecycle import PipelineResidency  # noqa: E402
from offload_core.streaming.device import DeviceCapacity, get_device  # noqa: E402
from offload_core.tables import HostTablesConfig  # noqa: E402

# Configured link figures (no GPU here): PCIe Gen4 x16 pinned, and the pageable figure the real
# model configs note. They shape time predictions only; bytes do not depend on them.
LINK = LinkFacts(pinned_Bps=25e9, pageable_Bps=8e9)
# The tiny umT5 table (256384 x 32 fp32 = 32.8 MB) is under the 256 MiB default: host it anyway.
TABLES = HostTablesConfig(min_bytes=1 << 20)
WAN_STAGES = (Stage("encode", ("text_encoder",)), Stage("denoise", ("transformer",)), Stage("decode", ("vae",)))
FLUX_STAGES = (Stage("encode", ("text_encoder", "text_encoder_2")), Stage("denoise", ("transformer",)),
               Stage("decode", ("vae",)))


def _materialized(comps):
    """Fresh allocations, as on a device: mapped weights sit at the file's alignment otherwise."""
    for module in comps.values():
        for p in module.parameters():
            p.data = p.data.clone()
    return comps


def wan(folder_fn, steps: int):
    def load():
        from diffusers import WanPipeline

        pipe = WanPipeline.from_pretrained(folder_fn())
        pipe.set_progress_bar_config(disable=True)
        comps = _materialized({"text_encoder": pipe.text_encoder, "transformer": pipe.transformer, "vae": pipe.vae})

        def call():
            return pipe("a cat", negative_prompt="blurry", height=16, width=16, num_frames=5,
                        num_inference_steps=steps, generator=torch.Generator().manual_seed(0),
                        output_type="pt").frames
        return comps, call
    return load, WAN_STAGES


def flux(steps: int):
    def load():
        from diffusers import FluxPipeline

        from zoo.tiny import ensure_tiny_flux

        pipe = FluxPipeline.from_pretrained(ensure_tiny_flux())
        pipe.set_progress_bar_config(disable=True)
        comps = _materialized({"text_encoder": pipe.text_encoder, "text_encoder_2": pipe.text_encoder_2,
                               "transformer": pipe.transformer, "vae": pipe.vae})

        def call():
            return pipe("a cat", height=32, width=32, num_inference_steps=steps, max_sequence_length=16,
                        generator=torch.Generator().manual_seed(0), output_type="pt").images
        return comps, call
    return load, FLUX_STAGES


def run_pipeline(name: str, load, stages, requests: int) -> dict:
    comps, call = load()
    figures = measure_warmup(comps, call)
    with torch.no_grad():
        reference = call()
    facts = PipelineFacts(profiles_from_warmup(comps, figures, TABLES), stages, 0, LINK, 1 << 34)
    memory_peak = plan_pipeline(facts, PerformanceMode.MEMORY).peak_device_bytes
    capacity = memory_peak + memory_peak // 2
    facts = PipelineFacts(facts.components, stages, capacity, LINK, 1 << 34, device_name="cpu")
    device = get_device("cpu")
    before = device.facts
    device.configure(DeviceCapacity(capacity_bytes=capacity))
    rows = {}
    del comps, call
    try:
        for mode in (PerformanceMode.SPEED, PerformanceMode.MEMORY, PerformanceMode.BALANCED, PerformanceMode.AUTO):
            rows[mode.value] = run_mode(load, plan_pipeline(facts, mode), reference, requests)
    finally:
        device.configure(before)
    speed = rows["speed"]
    for row in rows.values():
        row["peak_vs_speed"] = round(row["peak_device_bytes"] / speed["peak_device_bytes"], 4)
        row["time_vs_speed"] = round(row["request_s"] / speed["request_s"], 3)
    return {"pipeline": name, "capacity_bytes": capacity, "modes": rows}


def run_mode(load, plan, reference, requests: int) -> dict:
    comps, call = load()
    res = PipelineResidency.apply(comps, plan, "cpu", tables=TABLES)
    measured, seconds, equal = [], [], True
    for _ in range(requests):
        start = time.perf_counter()
        with res.following_calls(), torch.no_grad():
            out = call()
        measured.append(res.finish_request())
        seconds.append(time.perf_counter() - start)
        equal = equal and torch.equal(out, reference)
    res.remove()
    del res, comps, call
    gc.collect()  # the CPU device counts live meters in its headroom: drop this mode's
    last = measured[-1]
    return {"strategies": {c.name: c.strategy.value + ("+park" if c.prediction.parked else "")
                           + (f"+{c.resident_layers}res" if c.resident_layers else "") for c in plan.components},
            "peak_device_bytes": last.peak_device_bytes, "bytes_moved": last.bytes_moved,
            "predicted_peak": plan.peak_device_bytes, "predicted_moved": plan.bytes_moved_per_request,
            "peak_error": max(abs(m.peak_device_bytes - plan.peak_device_bytes) for m in measured),
            "moved_error": max(abs(m.bytes_moved - plan.bytes_moved_per_request) for m in measured),
            "request_s": round(min(seconds), 4), "bitwise_equal": equal}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps and requests (< 40 s)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    import diffusers
    import transformers

    diffusers.utils.logging.disable_progress_bar()
    transformers.utils.logging.disable_progress_bar()
    from zoo.tiny import ensure_medium_wan, ensure_tiny_wan

    steps, requests = (2, 2) if args.quick else (4, 3)
    cases = [("tiny-wan", *wan(ensure_tiny_wan, steps)), ("medium-wan", *wan(ensure_medium_wan, steps)),
             ("tiny-flux", *flux(steps))]
    results = []
    for name, load, stages in cases:
        result = run_pipeline(name, load, stages, requests)
        results.append(result)
        print(f"\n{name}: CPU device capacity {result['capacity_bytes']} B ({steps} steps, {requests} request(s))")
        print(f"{'mode':9} {'peak B':>11} {'vs speed':>8} {'moved B/req':>12} {'time vs speed':>13} "
              f"{'peak err':>8} {'moved err':>9} {'bitwise':>7}  strategies")
        for mode, row in result["modes"].items():
            print(f"{mode:9} {row['peak_device_bytes']:>11} {row['peak_vs_speed']:>8.3f} {row['bytes_moved']:>12} "
                  f"{row['time_vs_speed']:>13.2f} {row['peak_error']:>8} {row['moved_error']:>9} "
                  f"{str(row['bitwise_equal']):>7}  {row['strategies']}")
    worst = max(max(r["peak_error"], r["moved_error"]) for res in results for r in res["modes"].values())
    fields = {"bench": "modes", "quick": args.quick, "max_prediction_error_bytes": worst,
              "all_bitwise_equal": all(r["bitwise_equal"] for res in results for r in res["modes"].values()),
              "results": results}
    return checks.finish(fields, verdict(fields))


def verdict(fields: dict) -> list[checks.TargetCheck]:
    """On CPU the planner predicts peak and moved bytes exactly, and every mode's output is the plain one's."""
    return [checks.equal("max_prediction_error_bytes", fields["max_prediction_error_bytes"], 0),
            checks.equal("all_bitwise_equal", fields["all_bitwise_equal"], True)]


if __name__ == "__main__":
    sys.exit(main())
