"""What each process of a deployed application pays to import its code, before it does any work.

Every app deploy starts fresh Python processes: the node ledger actor (one per node), the residency
board and the job queue actors, the ingress replica and the stage replicas. Each imports its actor's
or deployment's module (Ray unpickles the class by reference). Per kind this times
``python -c "import <module>"`` from outside (CPU = user + sys of the child; wall) and says whether
torch came with it. ``--against DIR`` times another checkout (e.g. main's) with the same interpreter
in the same run, alternating the two, so load on a shared machine falls on both alike; medians of
``--repeats``; the load average is printed. The stage replica's figure is its module only: it then
imports diffusers (1.3 s of it torch._dynamo, which diffusers.utils.torch_utils imports) and the
family's pipeline class when it loads. The last line is one JSON object.

    .venv/bin/python bench/process_start.py --repeats 3 --against PATH/TO/OTHER/CHECKOUT
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
KINDS = {
    "node_ledger": "cluster.ledger.actor",
    "residency_board": "deployments.replica.board",
    "job_queue": "deployments.jobs.actor",
    "ingress": "deployments.ingress.deployment",
    "stage_replica": "deployments.replica.stages",
}
CHILD = ("import importlib, json, sys\n"
         "module = importlib.import_module(sys.argv[1])\n"
         "print(json.dumps({'torch': 'torch' in sys.modules, 'file': module.__file__}))\n")


def timed(module: str, checkout: Path) -> tuple[float, float, bool]:
    """(CPU s, wall s, torch imported) of one fresh interpreter importing ``module`` from ``checkout``."""
    env = {"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin", "PYTHONPATH": str(checkout), "HOME": os.environ["HOME"]}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", CHILD, module], env=env, cwd=checkout, check=True,
                          capture_output=True, text=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    out = json.loads(done.stdout.strip().splitlines()[-1])
    if not out["file"].startswith(str(checkout)):
        raise SystemExit(f"{module} came from {out['file']}, not from {checkout}")
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime), wall, out["torch"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--against", type=Path, default=None, help="another checkout to time in the same run")
    args = parser.parse_args()
    checkouts = {"this": REPO} | ({"against": args.against.resolve()} if args.against else {})
    figures: dict[str, dict[str, list]] = {c: {k: [] for k in KINDS} for c in checkouts}
    load_before = os.getloadavg()[0]
    for _ in range(args.repeats):
        for kind, module in KINDS.items():
            for name, checkout in checkouts.items():  # alternating: load falls on both alike
                figures[name][kind].append(timed(module, checkout))
    result: dict = {"load_before": round(load_before, 2), "load_after": round(os.getloadavg()[0], 2),
                    "repeats": args.repeats}
    for name, checkout in checkouts.items():
        result[name] = {"checkout": str(checkout)} | {
            kind: {"cpu_s": round(statistics.median(r[0] for r in runs), 2),
                   "wall_s": round(statistics.median(r[1] for r in runs), 2), "torch": runs[-1][2]}
            for kind, runs in figures[name].items()}
    for kind in KINDS:
        print(f"{kind:16s} " + "  ".join(f"{name}: {result[name][kind]['cpu_s']:.2f} s CPU "
                                          f"(torch {'yes' if result[name][kind]['torch'] else 'no'})"
                                          for name in checkouts))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
