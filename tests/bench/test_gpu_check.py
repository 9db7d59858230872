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
    assert [r["case"] for r in report["results"]] == ["medium-wan-denoiser", "wan2.1-1.3b-random",
                                                      "wan2.1-1.3b-random-1frame"]
    assert "need CUDA" in report["cuda_tests"]["skipped"]
    assert "needs CUDA" in report["activations"]["skipped"]
    assert "needs CUDA" in report["widen"]["skipped"]
    assert "skipped" in report["hook_cost"], "the prepared device run includes hook_cost --device cuda"
    medium, real, image = report["results"]
    for result in (medium, real):
        rows = result["rows"]
        assert result["streamed_bytes_per_step"] > 0
        for way in ("layerwise", "layerwise_pageable", "layerwise_mapped", "layerwise_pageable_unstaged",
                    "layerwise_fp8", "layerwise_fp8_fused"):
            assert rows[way]["bitwise_equal_to_speed"] is True, way
            assert rows[way]["measured_weight_peak_bytes"] == rows[way]["predicted_weight_peak_bytes"], way
        assert rows["layerwise_fp8"]["reference"] == rows["layerwise_fp8_fused"]["reference"] == "speed_fp8_reference"
        assert rows["layerwise_pageable"]["staging_bytes"] > 0, "pageable layers copy through pinned staging"
        assert rows["layerwise"]["staging_bytes"] == rows["layerwise_pageable_unstaged"]["staging_bytes"] == 0
        assert "needs CUDA" in rows["group_offload"]["skipped"]
    # mapped at real size: the weights saved and loaded back are views of the file, not copies
    assert real["rows"]["layerwise_mapped"]["file_mapped_fraction"] > 0.99
    assert set(image["rows"]) == {"speed", "layerwise", "speed_fp8_reference", "layerwise_fp8", "layerwise_fp8_fused"}
    assert image["rows"]["layerwise_fp8"]["bitwise_equal_to_speed"] is True
    assert image["rows"]["layerwise_fp8_fused"]["bitwise_equal_to_speed"] is True
    summary = report["summary"]
    assert set(summary) >= {"pageable_over_pinned", "mapped_over_pinned", "fp8_over_bf16_1frame",
                            "fp8_over_bf16_compute_bound", "fp8_fused_over_bf16_1frame",
                            "fp8_fused_over_bf16_compute_bound", "pinned_over_bound_1frame", "hook_us_per_layer",
                            "activation_error_min", "activation_error_max", "cuda_tests_failed",
                            "staged_GBps_omp1", "memcpy_GBps"}
    assert summary["pageable_over_pinned"] > 0 and summary["fp8_over_bf16_1frame"] > 0
    assert summary["fp8_fused_over_bf16_compute_bound"] > 0
    assert summary["cuda_tests_failed"] is None and summary["staged_GBps_omp1"] is None, "not measured on CPU"


def test_the_summary_reads_failed_cuda_tests_from_pytest_and_ratios_from_the_rows():
    import sys

    sys.path.insert(0, str(REPO / "bench"))
    from gpu_summary import cuda_tests_failed, summary

    assert cuda_tests_failed({"returncode": 1, "summary": "1 failed, 43 passed in 80.1s"}) == 1
    assert cuda_tests_failed({"returncode": 0, "summary": "44 passed, 2 skipped in 80.1s"}) == 0
    assert cuda_tests_failed({"skipped": "the CUDA-only tests need CUDA"}) is None
    # Nothing ran, so nothing counted: never "0 failed" (the device then reads as if every test passed).
    assert cuda_tests_failed({"returncode": 3, "summary": "no tests ran in 12.12s"}) is None
    assert cuda_tests_failed({"returncode": 124, "summary": "timed out after 150 s"}) is None
    assert cuda_tests_failed({"returncode": 2, "summary": "614 deselected, 14 errors in 14.42s"}) == 14
    rows = {"layerwise": {"step_s": 0.1, "median_step_s": 0.1, "bound_s": 0.08},
            "layerwise_pageable": {"step_s": 0.12}, "layerwise_fp8": {"step_s": 0.1, "median_step_s": 0.06}}
    figures = summary({"staged_GBps": 20.0, "memcpy_GBps": 28.0}, {"rows": rows}, {"rows": rows},
                      {"hook_us_per_layer_max": 50.0,
                       "hook_us_per_layer": {"wan2.1-14b-structure": 50.0, "wan2.1-14b-structure-denoise": 30.0}},
                      {"rows": [{"error": -0.02, "error_requested": -0.01}, {"error": 0.2, "error_requested": 0.03}]},
                      {"returncode": 0, "summary": "44 passed"})
    assert figures["pageable_over_pinned"] == 1.2 and figures["fp8_over_bf16_1frame"] == 0.6
    assert figures["pinned_over_bound_1frame"] == 1.25 and figures["mapped_over_pinned"] is None
    assert (figures["activation_error_min"], figures["activation_error_max"]) == (-0.02, 0.2)
    assert (figures["activation_error_requested_min"], figures["activation_error_requested_max"]) == (-0.01, 0.03)
    assert figures["hook_us_per_layer"] == 50.0 and figures["hook_us_per_layer_denoise"] == 30.0
    assert figures["staged_GBps_omp1"] == 20.0


def test_a_sub_bench_gets_what_the_run_budget_leaves_and_is_not_started_when_it_is_spent():
    import sys
    import time

    sys.path.insert(0, str(REPO / "bench"))
    import gpu_parts

    given = []

    def run(timeout_s):
        given.append(timeout_s)
        return {"returncode": 0}
    assert gpu_parts.within(time.monotonic() + 100, "x", 120, run) == {"returncode": 0}
    assert 100 - gpu_parts.REPORT_S - 2 <= given[0] <= 100 - gpu_parts.REPORT_S, "cut to what is left"
    assert gpu_parts.within(None, "x", 120, run) == {"returncode": 0} and given[-1] == 120
    spent = gpu_parts.within(time.monotonic() + 20, "x", 120, run)
    assert spent["returncode"] == 124 and "not started" in spent["summary"] and len(given) == 2
    assert gpu_parts.within(None, "x", 0, run) == {"skipped": "--x-timeout 0"}


def test_a_rerun_names_the_cases_it_runs_and_the_summary_reads_each_by_name():
    """A device session with minutes left reruns what a fix touched (``--cases``)."""
    import sys

    sys.path.insert(0, str(REPO / "bench"))
    import gpu_check
    from gpu_summary import summary_of

    assert gpu_check.chosen_cases(",".join(gpu_check.CASES)) == list(gpu_check.CASES)
    assert gpu_check.chosen_cases("") == []
    assert gpu_check.chosen_cases("wan2.1-1.3b-random-1frame") == ["wan2.1-1.3b-random-1frame"]
    with pytest.raises(ValueError, match=r"--cases: unknown \['wan2.1'\]; the cases are"):
        gpu_check.chosen_cases("wan2.1,medium-wan-denoiser")
    rows = {"layerwise": {"step_s": 0.1, "median_step_s": 0.1, "bound_s": 0.08},
            "layerwise_fp8": {"step_s": 0.1, "median_step_s": 0.06}}
    only_image = [{"case": "wan2.1-1.3b-random-1frame", "rows": rows}]
    figures = summary_of({}, only_image, {}, {}, {"skipped": "not asked"})
    assert figures["fp8_over_bf16_1frame"] == 0.6, "the image regime's ratio read from its own case"
    assert figures["fp8_over_bf16_compute_bound"] is None, "the 6-frame case did not run: no ratio, not its rows"
