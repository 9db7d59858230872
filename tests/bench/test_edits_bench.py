"""bench/edits.py runs, prints its JSON last, and holds its edits to the img2img pipeline bitwise."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_edits_bench_prints_the_steps_each_strength_runs_and_is_bitwise_the_pipeline():
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "edits.py"), "--family", "flux", "--side", "32",
                          "--steps", "4", "--reps", "1"], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert run.returncode == 0, run.stderr[-2000:]
    summary = json.loads(run.stdout.strip().splitlines()[-1])
    assert [(r["strength"], r["steps_run"]) for r in summary["rows"]] == [(None, 4), (0.25, 1), (0.6, 3), (1.0, 4)]
    assert summary["bitwise_img2img_pipeline"] is True and summary["rows"][0]["encode_s"] == 0


def test_the_edits_bench_on_wan_edits_a_video_and_is_bitwise_the_video_to_video_pipeline():
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "edits.py"), "--family", "wan", "--side", "32",
                          "--steps", "4", "--reps", "1", "--frames", "5"], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert run.returncode == 0, run.stderr[-2000:]
    summary = json.loads(run.stdout.strip().splitlines()[-1])
    # WanVideoToVideoPipeline's rule: each enters at 4 - int(4 x strength) and runs the rest.
    assert [(r["strength"], r["steps_run"]) for r in summary["rows"]] == [(None, 4), (0.25, 1), (0.6, 2), (1.0, 4)]
    assert summary["frames"] == 5 and summary["bitwise_img2img_pipeline"] is True
