"""bench/lora.py's verdict (exit 1 naming the missed check) and its real-size projection's arithmetic."""
from __future__ import annotations

import pytest

from bench.lora import flux_projection
from tests.bench.test_bench_verdicts import run_bench

MEASURED = """
def measure(rank, rounds, steps):
    return {{"bench": "lora", "model": "medium-wan", "clients": 4, "rank": rank, "steps": steps, "rounds": rounds,
            "layers_streamed": 8, "linears_adapted": 80, "step_s_base": 1.0, "step_s_4_adapters": {ratio},
            "step_ratio_4_adapters": {ratio}, "bytes_per_request_base": 100, "bytes_per_request_4_adapters": {nbytes},
            "bytes_per_request_ratio": {nbytes} / 100, "adapter_device_bytes": 4, "adapters_loaded": 4,
            "projection": bench.flux_projection(64)}}
bench.measure = measure
"""


def test_lora_bench_exits_1_over_115_percent_step_time_or_more_bytes_per_request():
    code, report, out = run_bench("lora", MEASURED.format(ratio=1.2, nbytes=101), "--quick")
    assert (code, report["failed"]) == (1, ["step_ratio_4_adapters", "bytes_per_request_ratio"])
    assert "MISSED: step_ratio_4_adapters = 1.2 (target <= 1.15)" in out
    code, report, _ = run_bench("lora", MEASURED.format(ratio=1.1, nbytes=100), "--quick")
    assert (code, report["failed"]) == (0, [])


def test_the_flux_projection_counts_the_low_rank_term_against_the_whole_step():
    projection = flux_projection(64)
    # 4096 image + 512 text tokens at 1024x1024; FLUX.1-dev's blocks are ~8.6 B parameters of Linears
    # (2 FLOPs per MAC per token) plus attention: ~74 TFLOP per forward.
    assert projection["tokens"] == 4608 and 70_000 < projection["step_gflops"] < 80_000
    # A rank-r term costs r*(in+out) MACs against in*out: 2*64/3072 for a square Linear, less for the
    # MLP's; the attention's FLOPs dilute it further.
    assert 0.02 < projection["low_rank_flops_fraction"] < 2 * 64 / 3072
    assert flux_projection(128)["low_rank_gflops"] == pytest.approx(2 * projection["low_rank_gflops"], abs=0.2)
