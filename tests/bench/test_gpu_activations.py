"""bench/gpu_activations.py: the CUDA comparison's second fit, on requested bytes, tells the caching allocator's
slack from a wrong feature (run here on CPU, the allocator's slack put into the allocated figure by hand)."""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))  # the bench imports its siblings so

import gpu_activations  # noqa: E402
from gpu_activations import CallPeak  # noqa: E402

SLACK = 1 << 20  # the most a large cached block the allocator does not split adds to one tensor
ORDER = ["calibrate-image-a", "calibrate-image-a", "calibrate-image-b", "held-out"]  # each tiny-flux stage's calls


def test_slack_in_one_calibration_call_misses_on_allocated_bytes_and_not_on_requested_ones():
    calls: list[int] = []

    def cuda_like(call, device, weights) -> CallPeak:
        """The CPU peak as CUDA's requested bytes; the allocated bytes 1 MiB more in the measured small shape."""
        peak = gpu_activations.measure_call(call, device, weights)
        slack = SLACK if len(calls) % len(ORDER) == 1 else 0
        calls.append(peak.allocated)
        return CallPeak(peak.allocated + slack, peak.allocated)

    rows = gpu_activations.compare("tiny-flux", torch.device("cpu"), measure_peak=cuda_like)

    assert [r["stage"] for r in rows] == ["encode", "denoise", "decode"]
    for row in rows:
        assert [c[0] for c in row["calls"]] == ORDER, "the slack goes into the measured calibrate-image-a call"
        assert abs(row["error_requested"]) < 0.02, row
        assert row["requested_measured_bytes"] == row["measured_bytes"], "no slack in the held-out call"
    # 1 MiB over in the n=1 shape: the fit's per-request term grows, its per-token (per-pixel) term shrinks
    by_stage = {r["stage"]: r for r in rows}
    assert by_stage["denoise"]["error"] > 0.3 and by_stage["decode"]["error"] > 0.3


def test_on_cpu_the_rows_say_there_is_no_requested_figure():
    rows = gpu_activations.compare("tiny-flux", torch.device("cpu"))
    assert {r["error_requested"] for r in rows} == {None}
    assert all(abs(r["error"]) < 0.02 and all(c[2] is None for c in r["calls"]) for r in rows)


def test_the_tiled_decoder_comparison_runs_on_cpu_within_band():
    """gpu_check's CUDA run compares a tiling decoder too; on CPU it runs tiny FLUX.1's, so CI keeps it working."""
    rows = gpu_activations.compare_tiled(torch.device("cpu"))
    assert [r["model"] for r in rows] == ["tiny-flux"] * 2 and rows[0]["tile_px"] == 32
    assert all(-0.10 <= r["error"] <= 0.15 and r["tiled_over_untiled_peak"] < 1 for r in rows), rows
