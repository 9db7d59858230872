"""Every bench with a target exits 1 when it misses it or a correctness check fails, and says which.

Each bench runs in its own process, as a user runs it, with its measurement replaced by figures
that miss (the measuring itself takes 20-60 s per bench; bench/checks.py's verdict, the JSON line
and the exit status are what is checked here), and for some once with figures that meet every
target (the verdict is shared: bench/checks.py).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench import checks

REPO = Path(__file__).resolve().parents[2]


def run_bench(module: str, patch: str, *args: str, env: dict | None = None) -> tuple[int, dict, str]:
    """``bench/<module>.py args`` in a fresh process after ``patch`` (Python, ``bench`` is the module)."""
    code = "\n".join([
        "import sys",
        f"sys.path.insert(0, {str(REPO)!r})",
        f"sys.argv = [{module + '.py'!r}, *{list(args)!r}]",
        f"import bench.{module} as bench",
        patch,
        "sys.exit(bench.main())",
    ])
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=180,
                          env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})
    lines = done.stdout.strip().splitlines()
    assert lines and lines[-1].startswith("{"), done.stderr[-3000:]
    return done.returncode, json.loads(lines[-1]), done.stdout


HOOKS = "bench.measure_all = lambda requests, device='cpu': [bench.HookCost('tiny-wan', 4, 10, 8, {us}, {us}, 20.0, " \
        "5.0, 1.0)]"


def test_hook_cost_exits_1_over_50_us_per_layer():
    code, report, out = run_bench("hook_cost", HOOKS.format(us=80.0), "--quick")
    assert (code, report["failed"]) == (1, ["hook_us_per_layer_max"])
    assert "MISSED: hook_us_per_layer_max = 80.0 (target <= 50.0)" in out


STREAMED = """
bench.measure = lambda args, device, repeats: bench.Measured(
    8, 1000, ((1.0, 0.1),) * 3, ((1.0, 0.1),) * 3, ((1.0, 0.2),) * 3, {peak}, 100, "formula", (0.0,) * 3, 1000,
    {bitwise}, True)
from bench.hook_cost import HookCost
bench.measure_all = lambda requests, device="cpu": [HookCost("tiny-wan", 4, 10, 8, 10.0, 10.0, 5.0, 1.0, 1.0)]
"""


def test_streaming_exits_1_when_not_bitwise_equal_or_the_peak_is_not_the_prediction():
    code, report, out = run_bench("streaming", STREAMED.format(peak=101, bitwise=False), "--quick")
    assert code == 1 and report["failed"] == ["peak_bytes", "bitwise_equal"]
    assert "MISSED: peak_bytes = 101 (target == 100)" in out
    code, report, _ = run_bench("streaming", STREAMED.format(peak=100, bitwise=True), "--quick")
    assert (code, report["failed"]) == (0, [])


def test_streaming_exits_1_over_its_overhead_target_set_through_bench_targets():
    code, report, out = run_bench("streaming", STREAMED.format(peak=100, bitwise=True), "--quick",
                                  env={checks.TARGETS_ENV: '{"overhead_ratio": 0.5}'})
    assert code == 1 and report["failed"] == ["overhead_ratio"] and report["overhead_ratio"] == 1.0
    assert "target <= 0.5" in out


MODES = """
row = dict(peak_device_bytes=10, peak_vs_speed=1.0, bytes_moved=0, time_vs_speed=1.0, peak_error={error},
           moved_error=0, bitwise_equal={bitwise}, strategies={{}})
bench.run_pipeline = lambda name, load, stages, requests: {{"pipeline": name, "capacity_bytes": 1, "modes": {{
    "speed": dict(row, bitwise_equal=True), "memory": row}}}}
"""


def test_modes_exits_1_when_a_mode_is_not_bitwise_equal_or_mispredicts():
    code, report, _ = run_bench("modes", MODES.format(error=4096, bitwise=False), "--quick")
    assert (code, report["failed"]) == (1, ["max_prediction_error_bytes", "all_bitwise_equal"])


HOST = """
bench.measure = lambda repeats: {{"pageable_anon_ratio": {pageable}, "mapped_anon_ratio": 0.01, "repeats": repeats}}
"""


def test_host_memory_exits_1_when_a_mode_holds_a_second_copy():
    code, report, _ = run_bench("host_memory", HOST.format(pageable=1.2), "--quick")
    assert (code, report["failed"]) == (1, ["pageable_anon_ratio"])


SHARED = """
def row(first, bitwise=True):
    return {{"hosting_s": 1.0 if first else 0.1, "ready_s": 2.0, "page_faults": 0, "bitwise": bitwise,
            "layer_bytes": 100, "stores": []}}
bench.measure = lambda quick: [
    {{"replicas": 1, "share": True, "over_one_copy": 1.0, "host_layer_bytes": 100, "rows": [row(True)]}},
    {{"replicas": 2, "share": True, "over_one_copy": {over}, "host_layer_bytes": 100,
     "rows": [row(True), row(False, {bitwise})]}},
    {{"replicas": 2, "share": False, "over_one_copy": 2.0, "host_layer_bytes": 200, "rows": [row(True), row(True)]}}]
"""


@pytest.mark.parametrize("over, bitwise, failed", [
    (1.5, False, ["max_host_layer_bytes_over_one_copy", "bitwise_every_replica"]), (1.0, True, [])])
def test_shared_host_exits_1_over_one_copy_or_when_a_replica_is_not_bitwise_equal(over, bitwise, failed):
    code, report, _ = run_bench("shared_host", SHARED.format(over=over, bitwise=bitwise), "--quick")
    assert (code, report["failed"]) == (1 if failed else 0, failed)


TP = """
bench.measure = lambda calls: {{"rank_weight_bytes_over_unsharded": {share}, "real_umt5_xxl_rank_over_unsharded": 0.5,
                                "calls": calls}}
"""


def test_tp_exits_1_when_a_rank_holds_over_its_share():
    code, report, _ = run_bench("tp", TP.format(share=0.7), "--quick")
    assert (code, report["failed"]) == (1, ["rank_weight_bytes_over_unsharded"])


GPU_CHECK = """
def run_case(name, build, shape, steps, device, link, **options):
    way = {{"step_s": 1.0, "median_step_s": 1.0, "step_vs_speed": 1.0, "peak_allocated_bytes": 0,
           "bitwise_equal_to_speed": {bitwise},
           "predicted_weight_peak_bytes": 100, "measured_weight_peak_bytes": {peak}}}
    return {{"case": name, "input_shape": list(shape), "streamed_bytes_per_step": 1,
            "rows": {{"speed": {{"step_s": 1.0, "median_step_s": 1.0, "step_vs_speed": 1.0, "peak_allocated_bytes": 0,
                               "bitwise_equal_to_speed": True}},
                     "layerwise": way, "group_offload": {{"skipped": "needs CUDA"}}}}}}
bench.run_case = run_case
"""


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="on CUDA the sub-runs are real")
def test_gpu_check_exits_1_when_a_streamed_way_is_not_bitwise_equal_or_its_peak_is_not_predicted():
    code, report, _ = run_bench("gpu_check", GPU_CHECK.format(bitwise=False, peak=101), "--steps", "1")
    assert code == 1
    assert report["failed"] == ["medium-wan-denoiser/layerwise: bitwise_equal_to_speed",
                                "medium-wan-denoiser/layerwise: measured_weight_peak_bytes 101 != predicted 100",
                                "wan2.1-1.3b-random/layerwise: bitwise_equal_to_speed",
                                "wan2.1-1.3b-random/layerwise: measured_weight_peak_bytes 101 != predicted 100",
                                "wan2.1-1.3b-random-1frame/layerwise: bitwise_equal_to_speed",
                                "wan2.1-1.3b-random-1frame/layerwise: measured_weight_peak_bytes 101 != predicted 100"]
    code, report, _ = run_bench("gpu_check", GPU_CHECK.format(bitwise=True, peak=100), "--steps", "1")
    assert (code, report["failed"]) == (0, [])


def test_bench_targets_must_name_checks_the_bench_has(monkeypatch, capsys):
    monkeypatch.setenv(checks.TARGETS_ENV, '{"overhead_ratoi": 2}')
    with pytest.raises(SystemExit, match="overhead_ratoi.*its checks: \\['overhead_ratio'\\]"):
        checks.finish({}, [checks.at_most("overhead_ratio", 1.0, 1.05)])
    monkeypatch.setenv(checks.TARGETS_ENV, "overhead_ratio=2")
    with pytest.raises(SystemExit, match="BENCH_TARGETS is not JSON"):
        checks.at_most("overhead_ratio", 1.0, 1.05)
