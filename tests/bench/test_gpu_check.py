"""bench/gpu_check.sh keeps working without a GPU: its CPU mode runs every non-CUDA part end to end."""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU mode is what CI runs; on CUDA run the script itself")
def test_gpu_check_runs_in_cpu_mode_and_streams_bitwise_equal():
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHON": str(REPO / ".venv/bin/python")}
    done = subprocess.run(["bash", "bench/gpu_check.sh", "--real-blocks", "1", "--steps", "1"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["cuda"] is False and "skipped" in report["bandwidth"]
    assert [r["case"] for r in report["results"]] == ["medium-wan-denoiser", "wan2.1-1.3b-random"]
    assert "need CUDA" in report["cuda_tests"]["skipped"]
    assert "needs CUDA" in report["activations"]["skipped"]
    assert "needs CUDA" in report["widen"]["skipped"]
    assert "skipped" in report["hook_cost"], "the prepared device run includes hook_cost --device cuda"
    for result in report["results"]:
        rows = result["rows"]
        assert result["streamed_bytes_per_step"] > 0
        for way in ("layerwise", "layerwise_pageable", "layerwise_pageable_unstaged"):
            assert rows[way]["bitwise_equal_to_speed"] is True, way
            assert rows[way]["measured_weight_peak_bytes"] == rows[way]["predicted_weight_peak_bytes"], way
        assert rows["layerwise_pageable"]["staging_bytes"] > 0, "pageable layers copy through pinned staging"
        assert rows["layerwise"]["staging_bytes"] == rows["layerwise_pageable_unstaged"]["staging_bytes"] == 0
        assert "needs CUDA" in rows["group_offload"]["skipped"]
