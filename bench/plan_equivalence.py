"""Every real-size plan the search makes, as JSON: to show that a faster search plans exactly the same.

For each model in configs/models/real_model_configs.json, on the smallest GPU in its ``gpus``, L4,
A100-80GB and H100, in every performance mode, with 16 GiB and 64 GiB of host RAM, it runs
``plan_pipeline`` and records every component's ``decisions()`` and prediction (staging reasons too)
and the plan's peak, times, bytes moved, pinned bytes and feasibility: floats as Python writes them
(round-trip exact), so equal files mean equal plans to the last bit.

    .venv/bin/python bench/plan_equivalence.py --write before.json   # with the search as it was
    .venv/bin/python bench/plan_equivalence.py --check before.json   # after a change: exit 1 on any difference

``--check`` names every case that differs and the first field that does. Run by hand; the facts come
from the facts cache when warm (they do not depend on the search).
"""
from __future__ import annotations

import argparse
import dataclasses
import enum
import json
import logging
import sys
import time
from pathlib import Path

from offload_core.planner import gpus, real_models
from offload_core.planner.inputs import gpu_spec, real_model_facts
from offload_core.planner.pipeline_plan import PerformanceMode, PipelinePlan
from offload_core.planner.search import plan_pipeline

GiB = 2**30
HOST_RAM = (16 * GiB, 64 * GiB)
BIG_GPUS = ("L4", "A100-80GB", "H100")


def _plain(value):
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def plan_record(plan: PipelinePlan) -> dict:
    """What makes two plans the same: decisions, predictions and the plan's totals."""
    return {
        "components": [{"decisions": _plain(c.decisions()), "staging_why": c.staging_why,
                        "prediction": _plain(dataclasses.asdict(c.prediction))} for c in plan.components],
        **{k: _plain(getattr(plan, k)) for k in (
            "peak_device_bytes", "peak_stage", "bytes_moved_per_request", "transfer_s_per_request",
            "compute_s_per_request", "time_s_per_request", "pinned_bytes", "staging_bytes", "feasible",
            "weight_budget", "notes")},
    }


def gpu_names() -> list[str]:
    """The smallest GPU in the config file, then the big ones."""
    smallest = min(gpus.gpu_names(), key=lambda name: gpu_spec(name).memory_bytes)
    return [smallest, *(g for g in BIG_GPUS if g != smallest)]


def all_plans(models: list[str]) -> tuple[dict[str, dict], dict[str, float]]:
    """Plans by case name, and the search's seconds per model (facts excluded)."""
    out, seconds = {}, {}
    for model in models:
        seconds[model] = 0.0
        for gpu in gpu_names():
            for ram in HOST_RAM:
                facts, _ = real_model_facts(model, gpu_spec(gpu), ram)
                for mode in PerformanceMode:
                    start = time.process_time()
                    plan = plan_pipeline(facts, mode)
                    seconds[model] += time.process_time() - start
                    out[f"{model}/{gpu}/{ram // GiB}GiB/{mode.value}"] = plan_record(plan)
    return out, seconds


def first_difference(a, b, path: str = "") -> str:
    if type(a) is not type(b):
        return f"{path}: {a!r} != {b!r}"
    if isinstance(a, dict):
        for key in sorted(set(a) | set(b)):
            if key not in a or key not in b:
                return f"{path}/{key}: only in {'reference' if key in a else 'now'}"
            found = first_difference(a[key], b[key], f"{path}/{key}")
            if found:
                return found
        return ""
    if isinstance(a, list):
        if len(a) != len(b):
            return f"{path}: {len(a)} items != {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            found = first_difference(x, y, f"{path}[{i}]")
            if found:
                return found
        return ""
    return "" if a == b else f"{path}: {a!r} != {b!r}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--write", type=Path, metavar="FILE.json", help="write every plan to FILE.json")
    what.add_argument("--check", type=Path, metavar="FILE.json", help="compare every plan with FILE.json")
    parser.add_argument("--models", nargs="*", help="only these models (default: every model in the config)")
    args = parser.parse_args()
    logging.disable(logging.INFO)  # one INFO line per decision: thousands here, and their cost is not the search's
    known = real_models.model_names()
    models = args.models or known
    unknown = sorted(set(models) - set(known))
    if unknown:
        parser.error(f"unknown models {unknown}; the config has {known}")
    plans, seconds = all_plans(models)
    print("search CPU s per model (all cases): " + ", ".join(f"{m} {s:.2f}" for m, s in seconds.items()))
    if args.write:
        args.write.write_text(json.dumps(plans, indent=0, sort_keys=True))
        print(f"{len(plans)} plans written to {args.write}")
        return 0
    reference = json.loads(args.check.read_text())
    missing = sorted(set(plans) - set(reference))
    differ = {case: first_difference(reference[case], plans[case]) for case in plans if case in reference}
    differ = {case: why for case, why in differ.items() if why}
    for case, why in differ.items():
        print(f"DIFFERS {case}: {why}")
    if missing:
        print(f"not in the reference: {missing}")
    print(f"{len(plans) - len(differ) - len(missing)} of {len(plans)} plans identical to {args.check}")
    return 1 if differ or missing else 0


if __name__ == "__main__":
    sys.exit(main())
