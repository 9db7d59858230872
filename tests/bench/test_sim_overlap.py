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
    cases = {(c["tier"], c["depth"], c["model"]) for c in report["cases"]}
    assert cases == {(t, d, m) for t in ("pinned", "pageable", "mapped") for d in (1, 2)
                     for m in ("copy-bound", "balanced", "compute-bound")}
    assert report["all_bitwise_equal"] is True and report["all_peaks_predicted"] is True
    # staged pageable/mapped copies and pinned ones: the step is max(copy, compute) + one layer's copy
    assert report["engine_stages_copies"] is True
    assert report["max_ratio"] <= 1.05, [(c["tier"], c["depth"], c["model"], c["ratio"]) for c in report["cases"]]
    # staging off: the driver's blocking pageable copy serialises copy and compute (ratio ~2)
    assert report["negative_control_ratio"] >= 1.5
    for case in report["cases"]:
        assert case["copy_bound_by"] == ("dma" if case["tier"] == "pinned" else "host_memcpy")
