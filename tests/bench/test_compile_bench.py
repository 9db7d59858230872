"""bench/compile.py exits 1 when a request recompiles after warm-up or streamed compiled output is not
bitwise the resident compiled output, naming the check (measurement replaced: compiling takes ~1 min)."""
from __future__ import annotations

from offload_core.compile import RequestShape
from tests.bench.test_bench_verdicts import run_bench

COMPILE = """
from offload_core.compile import BucketWarmup, RequestShape
shapes = (RequestShape(64, 128), RequestShape(128, 128))
steps = {{"resident": {{s: 0.002 for s in shapes}}, "streamed": {{s: 0.0025 for s in shapes}},
         "streamed_fp8": {{s: 0.002 for s in shapes}}}}
bench.measure = lambda args: {{"served": shapes, "warm": {{"resident": (BucketWarmup("all", 3, 20.0, 1),)}},
    "eager_s": steps, "compiled_s": steps, "recompiles": {recompiles}, "bitwise": {bitwise}, "tolerance": True,
    "bound_s": None}}
"""


def test_compile_bench_exits_1_on_a_recompile_after_warmup_or_a_streamed_output_not_bitwise():
    code, report, out = run_bench("compile", COMPILE.format(recompiles=2, bitwise=False), "--quick",
                                  "--model", "tiny-wan", "--no-cache-probe")
    assert code == 1 and report["failed"] == ["recompiles_after_warmup", "streamed_bitwise_equal_resident_compiled"]
    assert "MISSED: recompiles_after_warmup = 2 (target == 0)" in out
    code, report, _ = run_bench("compile", COMPILE.format(recompiles=0, bitwise=True), "--quick",
                                "--model", "tiny-wan", "--no-cache-probe")
    assert (code, report["failed"]) == (0, []) and report["recompiles_after_warmup"] == 0
    assert report["streamed_bitwise_equal_resident_compiled"] is True
    # FP8 over bf16, both streamed and compiled, per served shape (issue 33's target where launches no longer bind)
    (model,) = report["models"]
    assert model["compiled_fp8_over_native_streamed"] == {str(RequestShape(64, 128)): 0.8,
                                                          str(RequestShape(128, 128)): 0.8}
