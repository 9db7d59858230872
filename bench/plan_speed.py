"""How long planning a real-size model (Wan2.1-T2V-14B + UMT5-XXL by default) takes, and how much of it is torch's import.

Each figure is a fresh process, timed from outside (wall, and CPU = user + sys of the child):
- ``torch_import``: ``python -c "import torch"``, the floor every plan pays;
- ``plan_cold``: ``offload-serve plan --model MODEL --gpu L4 --host-ram 64GiB`` as the
  first plan after a clone: an empty facts cache (``$OFFLOAD_SERVE_CACHE``, a fresh folder) and none of
  the project's own bytecode (``offload_core/**/__pycache__`` removed first; the libraries' bytecode is
  written when pip installs them, so a fresh machine has it). The components are rebuilt on ``meta``
  from the committed skeletons (offload_core/planner/skeletons.py);
- ``plan_warm``: the same command again (profiles from the facts cache, bytecode written);
- ``plan_libraries``: the cold plan with the skeletons ignored (``OFFLOAD_SERVE_PLAN_SKELETONS=0``):
  the components built by diffusers and transformers, as before the skeletons (``--no-libraries``: not run).
``*_beyond_torch`` subtract the median torch import. Runs alternate (torch, cold, warm) so load on
a shared machine falls on all three alike. Medians of ``--repeats``; the load average is printed.
The last line is one JSON object.

    .venv/bin/python bench/plan_speed.py --repeats 5
    .venv/bin/python bench/plan_speed.py --model sd3.5-large --no-libraries
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def plan_command(model: str) -> list[str]:
    return [sys.executable, "-m", "deployments.dev.cli", "plan", "--model", model, "--gpu", "L4", "--host-ram", "64GiB"]


def timed(argv: list[str], env: dict[str, str]) -> tuple[float, float]:
    """(wall s, CPU s) of one child process."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    subprocess.run(argv, env=env, cwd=REPO, check=True, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def drop_project_bytecode() -> None:
    """Remove offload_core's compiled bytecode, as a fresh clone has none."""
    for folder in (REPO / "offload_core").rglob("__pycache__"):
        shutil.rmtree(folder, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--model", default="wan2.1-t2v-14b", help="a model in configs/models/real_model_configs.json")
    parser.add_argument("--no-libraries", action="store_true", help="skip plan_libraries (diffusers' import is slow)")
    args = parser.parse_args()
    plan = plan_command(args.model)
    runs: dict[str, list[tuple[float, float]]] = {"torch_import": [], "plan_cold": [], "plan_warm": [],
                                                  "plan_libraries": []}
    load = os.getloadavg()[0]
    for _ in range(args.repeats):
        with tempfile.TemporaryDirectory() as cache:
            env = {**os.environ, "OFFLOAD_SERVE_CACHE": cache, "OFFLOAD_SERVE_PLAN_CACHE": "1",
                   "OMP_NUM_THREADS": "1"}
            runs["torch_import"].append(timed([sys.executable, "-c", "import torch"], env))
            drop_project_bytecode()
            runs["plan_cold"].append(timed(plan, env))
            runs["plan_warm"].append(timed(plan, env))
        if args.no_libraries:
            continue
        with tempfile.TemporaryDirectory() as cache:
            env = {**os.environ, "OFFLOAD_SERVE_CACHE": cache, "OFFLOAD_SERVE_PLAN_CACHE": "1",
                   "OFFLOAD_SERVE_PLAN_SKELETONS": "0", "OMP_NUM_THREADS": "1"}
            drop_project_bytecode()
            runs["plan_libraries"].append(timed(plan, env))
    out: dict[str, float] = {}
    runs = {name: pairs for name, pairs in runs.items() if pairs}
    for name, pairs in runs.items():
        out[f"{name}_wall_s"] = round(statistics.median(w for w, _ in pairs), 3)
        out[f"{name}_cpu_s"] = round(statistics.median(c for _, c in pairs), 3)
    out["model"] = args.model
    for name in (n for n in ("plan_cold", "plan_warm", "plan_libraries") if n in runs):
        for unit in ("wall", "cpu"):
            out[f"{name}_beyond_torch_{unit}_s"] = round(out[f"{name}_{unit}_s"] - out[f"torch_import_{unit}_s"], 3)
    out["load_average"] = round((load + os.getloadavg()[0]) / 2, 2)
    out["repeats"] = args.repeats
    for name, pairs in runs.items():
        print(f"{name:14s} wall {', '.join(f'{w:.2f}' for w, _ in pairs)} s; cpu {', '.join(f'{c:.2f}' for _, c in pairs)} s")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
