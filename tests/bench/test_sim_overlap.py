"""bench/sim_overlap.py: the simulated accelerator's overlap table, checked as CI runs it (--quick)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_sim_overlap_quick_shows_every_tier_overlapping_and_a_negative_control_that_serialises():
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "bench/sim_overlap.py", "--quick"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    even = {(c["tier"], c["depth"], c["model"]) for c in report["cases"] if c["shape"] == "even"}
    assert even == {(t, d, m) for t in ("pinned", "pageable", "mapped") for d in (1, 2)
                    for m in ("copy-bound", "balanced", "compute-bound")}
    shapes = {c["shape"] for c in report["cases"]}
    assert {"uneven", "slow-copier"} <= shapes and all(c["name"] for c in report["cases"])
    assert report["layers"] >= 34, "one layer under 3 % of the step: the +1 layer term hides no regression"
    assert report["all_bitwise_equal"] is True and report["all_peaks_predicted"] is True
    # staged pageable/mapped copies and pinned ones: the step is max(copy, compute) + one layer's copy,
    # with copy latency, launch cost and copier jitter paid
    assert report["max_ratio"] <= 1.05, [(c["name"], c["ratio"]) for c in report["cases"]]
    # staging off: the driver's blocking pageable copy serialises copy and compute (ratio ~2)
    assert report["negative_control_ratio"] >= 1.5
    for case in report["cases"]:
        assert case["copy_bound_by"] == ("dma" if case["tier"] == "pinned" else "host_memcpy")
