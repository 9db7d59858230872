"""What a stage replica's warm-up adds to its start-up (``added_s``): the timed call and the replan.

Each stage replica of the tiny zoo (Wan, Flux) is started as ``configs/local.yaml`` configures it
(its default request: 64x64, 9 frames for Wan), outside Serve, on this machine's CPU. Its warm-up
(``deployments/replica/warmup.py``) calibrates the activation model (what replicas did before they planned
from measurements: ``calibration_s``), times the layers on one 1-step call at the default request
shape and plans again (``added_s``: the start-up cost of planning from measurements). Medians of
``--repeats`` starts per stage; ``changed``: whether the measured plan differed from the first.

    OMP_NUM_THREADS=1 .venv/bin/python bench/warmup.py --quick
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from deployments.app import AppArgs, resolve_model_folder, stage_configs  # noqa: E402
from deployments.models import families  # noqa: E402
from deployments.replica.worker import StageWorker  # noqa: E402
from deployments.wire.spec import PipelineStage  # noqa: E402

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "local.yaml"


def local_args(family: str) -> AppArgs:
    args = dict(yaml.safe_load(CONFIG.read_text())["applications"][0]["args"])
    args.pop("api_token_env", None)  # no HTTP here: nothing to authenticate
    return AppArgs.model_validate({**args, "tiny_family": family})


def measure(family: str, repeats: int) -> dict:
    args = local_args(family)
    facts = families.read_family_traits(resolve_model_folder(args))
    out = {}
    for stage in PipelineStage:
        runs = []
        for _ in range(repeats):
            worker = StageWorker(stage_configs(args, facts)[stage])
            try:
                runs.append(worker.warmup)
            finally:
                worker.close()
        out[stage.value] = {
            "shape": runs[0].shape.describe(), "batch": runs[0].batch,
            "calibration_s": round(statistics.median(r.calibration_s for r in runs), 3),
            "added_s": round(statistics.median(r.seconds - r.calibration_s for r in runs), 3),
            "warmup_s": round(statistics.median(r.seconds for r in runs), 3),
            "changed": any(r.changes for r in runs)}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="3 starts per stage")
    opts = parser.parse_args()
    repeats = 3 if opts.quick else opts.repeats
    logging.basicConfig(level=logging.WARNING)
    result = {family: measure(family, repeats) for family in ("wan", "flux")}
    print(f"{'family':<6} {'stage':<8} {'shape':<9} {'batch':>5} {'calibration s':>13} {'added s':>8} "
          f"{'warm-up s':>9} changed")
    for family, stages in result.items():
        for stage, row in stages.items():
            print(f"{family:<6} {stage:<8} {row['shape']:<9} {row['batch']:>5} {row['calibration_s']:>13.3f} "
                  f"{row['added_s']:>8.3f} {row['warmup_s']:>9.3f} {row['changed']}")
    load = os.getloadavg()[0]
    print(f"medians of {repeats} starts per stage, on {os.cpu_count()} CPUs at load average {load:.2f}")
    print(json.dumps({"warmup": result, "repeats": repeats, "load_average": round(load, 2),
                      "added_s_per_app": {f: round(sum(r["added_s"] for r in s.values()), 3)
                                          for f, s in result.items()}}))


if __name__ == "__main__":
    main()
