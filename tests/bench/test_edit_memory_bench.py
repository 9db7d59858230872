"""bench/edit_memory.py runs and prints its JSON last: an edit's encode peaks within its decode's lease."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_edit_memory_bench_finds_each_encode_within_the_decode_the_lease_is_sized_by():
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "edit_memory.py"), "--quick"], capture_output=True,
                         text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert run.returncode == 0, run.stderr[-2000:]
    summary = json.loads(run.stdout.strip().splitlines()[-1])
    assert [(r["model"], r["frames"]) for r in summary["rows"]] == [("tiny-wan", 5)]
    assert 0 < summary["max_encode_over_decode"] <= 1, summary
