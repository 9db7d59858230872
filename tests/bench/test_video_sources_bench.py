"""bench/video_sources.py runs at a small size and prints its JSON last, every figure measured."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_video_sources_bench_times_the_upload_check_and_an_extensions_join():
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "video_sources.py"), "--source", "96x64", "--size",
                          "48x32", "--frames", "9", "--reps", "1"], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert run.returncode == 0, run.stderr[-2000:]
    summary = json.loads(run.stdout.strip().splitlines()[-1])
    assert set(summary["seconds"]) == {"check_upload", "last_frame", "decode_source", "encode_alone",
                                       "join_and_encode"}
    assert all(value > 0 for value in summary["seconds"].values()) and summary["frames"] == 9
