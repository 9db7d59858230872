"""Whether real-size plans keep within the host lease and the device budget they were made for.

For every model in configs/models/real_model_configs.json, on every GPU of its ``gpus`` table, with 8, 16,
24, 32 and 64 GiB of host RAM, in every performance mode, it runs ``plan_pipeline`` and counts the
plans that page-lock more host bytes than the lease (pins and staging buffers: ``pinned_bytes`` over
``host_lease_bytes``) and the feasible ones whose device peak is over the weight budget. A plan over
its lease is one the replica's host plan then cuts back at start, so the tiers it ran were not the
ones it was priced on (FLUX.1-dev, RTX3060, 24 GiB: 22.66 GiB pinned of a 22.0 GiB lease).

    .venv/bin/python bench/plan_leases.py            # ~4 minutes on the CI-class VM: 1,980 plans
    .venv/bin/python bench/plan_leases.py --quick    # 24 GiB only

Prints each plan over, then one JSON object; any plan over exits 1 (``bench/checks.py``).
"""
from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import checks  # noqa: E402
from offload_core.planner import gpus, real_models  # noqa: E402
from offload_core.planner.inputs import gpu_spec, real_model_facts  # noqa: E402
from offload_core.planner.pipeline_plan import PerformanceMode  # noqa: E402
from offload_core.planner.search import plan_pipeline  # noqa: E402

GiB = 2**30
HOST_RAM_GIB = (8, 16, 24, 32, 64)


def sweep(models: tuple[str, ...], gpu_names: tuple[str, ...],
          host_ram_gib: tuple[int, ...]) -> tuple[int, list[str], list[str], float]:
    """Plans made, those over the lease, those over the device budget, and the most GiB any was over the lease."""
    made, over_lease, over_budget, worst = 0, [], [], 0.0
    for model in models:
        for gpu in gpu_names:
            for ram in host_ram_gib:
                facts, _notes = real_model_facts(model, gpu_spec(gpu), ram * GiB)
                for mode in PerformanceMode:
                    plan, made = plan_pipeline(facts, mode), made + 1
                    case = f"{model} {gpu} {ram} GiB {mode.value}"
                    over = (plan.pinned_bytes - facts.host_lease_bytes) / GiB
                    if over > 0:
                        over_lease.append(f"{case}: {over:.3f} GiB pinned over the lease")
                        worst = max(worst, over)
                    if plan.feasible and plan.peak_device_bytes > plan.weight_budget:
                        over_budget.append(f"{case}: peak {plan.peak_device_bytes} B > {plan.weight_budget} B")
    return made, over_lease, over_budget, worst


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="24 GiB of host RAM only")
    args = parser.parse_args()
    logging.disable(logging.INFO)  # one line per plan decision otherwise
    start = time.perf_counter()
    made, over_lease, over_budget, worst = sweep(real_models.model_names(), gpus.gpu_names(),
                                                 (24,) if args.quick else HOST_RAM_GIB)
    for line in over_lease + over_budget:
        print(line)
    result = {"bench": "plan_leases", "plans": made, "over_lease": len(over_lease), "over_budget": len(over_budget),
              "most_over_lease_GiB": round(worst, 3), "seconds": round(time.perf_counter() - start, 1)}
    return checks.finish(result, [checks.equal("over_lease", len(over_lease), 0),
                                  checks.equal("over_budget", len(over_budget), 0)])


if __name__ == "__main__":
    sys.exit(main())
