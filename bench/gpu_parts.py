"""The sub-benches one device run (bench/gpu_check.py) runs after its cases, each in its own process and
within what the run's budget leaves, so the run's JSON comes out whatever they take: the engine's CUDA-only
tests, the activation model's CUDA calibration, FP8 widening on a Wan2.1-14B block, the staged pipeline's
sweep and the hooks' host time. Each says it was skipped where there is no CUDA.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

CUDA = torch.cuda.is_available()


# The selection, as pytest takes it; tests/offload_core/test_torch_only.py collects it as the device image
# has it: no pytest-xdist (the suite's conftest hooks into it), no pydantic, no Ray.
CUDA_TESTS = ("tests/offload_core", "-k", "cuda")


def _repo_env() -> tuple[Path, dict]:
    """The repository root and an environment whose PYTHONPATH finds the project from a subprocess."""
    root = Path(__file__).resolve().parents[1]
    return root, {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))}


def _bench_json(args: list[str], timeout_s: int) -> dict:
    """One bench script in a subprocess: its table printed here, its last line (one JSON object) returned
    with returncode 0, or the returncode and the error's last line."""
    root, env = _repo_env()
    try:
        done = subprocess.run([sys.executable, *args], cwd=root, env=env, capture_output=True, text=True,
                              timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"returncode": 124, "summary": f"timed out after {timeout_s} s"}
    lines = done.stdout.strip().splitlines()
    print("\n" + "\n".join(lines[:-1]), done.stderr[-2000:] if done.returncode else "", sep="\n", flush=True)
    if done.returncode == 1 and lines and lines[-1].startswith("{"):  # a bench that missed a target still reports
        return {**json.loads(lines[-1]), "returncode": 1}
    if done.returncode or not lines:
        return {"returncode": done.returncode, "summary": done.stderr.strip().splitlines()[-1:]}
    return {"returncode": 0, **json.loads(lines[-1])}


def cuda_tests(timeout_s: int) -> dict:
    """The engine's CUDA-only tests (stream safety, staging on a real GPU), in a subprocess."""
    if not CUDA:
        return {"skipped": "the CUDA-only tests need CUDA"}
    root, env = _repo_env()
    try:
        done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", *CUDA_TESTS],
                              cwd=root, env=env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as late:
        print(late.stdout[-4000:] if late.stdout else "", flush=True)
        return {"returncode": 124, "summary": f"timed out after {timeout_s} s"}
    print(done.stdout[-4000:], done.stderr[-2000:], sep="\n", flush=True)
    lines = done.stdout.strip().splitlines()
    return {"returncode": done.returncode, "summary": lines[-1] if lines else ""}


def activation_comparison(timeout_s: int) -> dict:
    """bench/gpu_activations.py on CUDA (a CPU calibration is not a CUDA one), in a subprocess: its
    table printed here, its JSON returned. On CPU the tests pin the same comparison."""
    if not CUDA:
        return {"skipped": "the CUDA calibration needs CUDA (tests/deployments/models/test_activation_features.py pins the CPU one)"}
    report = _bench_json(["bench/gpu_activations.py"], timeout_s)
    if report["returncode"]:
        return report
    return {"returncode": 0, "max_abs_error": report["max_abs_error"], "rows": report["rows"]}


def tiled_decode_comparison(timeout_s: int) -> dict:
    """bench/gpu_activations.py --tiled on CUDA, in a subprocess: a tiling decoder's two-phase prediction
    (deployments/models/tiled_activations.py) against ``max_memory_allocated`` beyond the tile, and its time
    against an untiled decode's. Not judged (no target yet): reported. On CPU the bench's test runs its CPU form."""
    if not CUDA:
        return {"skipped": "the tiled decode's CUDA figures need CUDA (tests/bench/test_gpu_activations.py runs it on CPU)"}
    report = _bench_json(["bench/gpu_activations.py", "--tiled"], timeout_s)
    if report["returncode"]:
        return report
    return {"returncode": 0, "error_min": report["error_min"], "error_max": report["error_max"],
            "rows": report["tiled_rows"]}


def widen_cost(timeout_s: int) -> dict:
    """bench/widen_cost.py on CUDA, in a subprocess: FP8 widening's cost per real-size Wan2.1-14B block
    beside the copy it saves. On CPU the bench runs on its own (docs/benchmarks.md has its figures)."""
    if not CUDA:
        return {"skipped": "the widen's cost beside the pinned copy needs CUDA (bench/widen_cost.py runs on CPU alone)"}
    return _bench_json(["bench/widen_cost.py", "--device", "cuda"], timeout_s)


def staged_sweep(timeout_s: int) -> dict:
    """bench/staged_sweep.py: the staged pipeline by chunks and threads, the memcpy alone, NUMA facts."""
    if not CUDA:
        return {"skipped": "the staged pipeline feeds a CUDA copy"}
    return _bench_json(["bench/staged_sweep.py"], timeout_s)


def hook_cost(timeout_s: int) -> dict:
    """bench/hook_cost.py --device cuda (the hooks' host time with a real copy stream and events)."""
    if not CUDA:
        return {"skipped": "bench/streaming.py --quick measures the hooks on CPU"}
    return _bench_json(["bench/hook_cost.py", "--device", "cuda"], timeout_s)


REPORT_S = 10  # what a run keeps for its summary and JSON after the last sub-bench
MIN_PART_S = 15  # a sub-bench given less is not started (its import alone takes seconds)


def within(budget: float | None, name: str, timeout_s: int, run) -> dict:
    """``run(timeout)`` with its timeout cut to what the run's ``budget`` (a monotonic deadline) leaves:
    the JSON is printed whatever the sub-benches take. Not started (exit 124, a failure) when too little is left."""
    if not timeout_s:
        return {"skipped": f"--{name}-timeout 0"}
    if budget is not None:
        left = int(budget - time.monotonic() - REPORT_S)
        if left < MIN_PART_S:
            return {"returncode": 124, "summary": f"not started: {left} s of the run's budget left"}
        timeout_s = min(timeout_s, left)
    return run(timeout_s)
