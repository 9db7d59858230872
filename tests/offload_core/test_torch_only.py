"""offload_core imports with torch alone: a GPU image with CUDA torch but none of the service's libraries runs it,
and the CUDA tests bench/gpu_check.py runs there collect on it."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# What the GPU machine's image lacks (its run at fcfd650 lost the CUDA tests and hook_cost to an engine
# import of pydantic; ../shared/gpu-wheels/README.md lists what it has). pytest-xdist ("xdist") too.
ABSENT_ON_GPU_IMAGE = ("pydantic", "tenacity", "ray", "fastapi", "starlette", "xdist")
BLOCK = f"""
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in {set(ABSENT_ON_GPU_IMAGE)!r}:
            raise ImportError(f'{{name}} is not installed on this image')
sys.meta_path.insert(0, Block())
"""
IMPORT = BLOCK + """
import offload_core, offload_core.residency.lifecycle, offload_core.streaming.engine, offload_core.planner.cli
import offload_core.lora
from offload_core.host.budget_cap import CappedBudget
print('ok')
"""
# gpu_check's sub-benches import there, and its selection of tests collects as that image runs it: one
# process, no xdist.
COLLECT = BLOCK + """
import pytest
sys.path.insert(0, 'bench')
import gpu_check
from gpu_parts import CUDA_TESTS
import gpu_activations, hook_cost, staged_sweep, widen_cost  # gpu_check's sub-benches on CUDA, each its own process
sys.exit(pytest.main(['-p', 'no:xdist', '-p', 'no:cacheprovider', '-qq', '--collect-only', *CUDA_TESTS]))
"""


def test_the_engine_and_the_planner_import_without_the_services_libraries():
    done = subprocess.run([sys.executable, "-c", IMPORT], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


def test_the_cuda_tests_collect_and_the_sub_benches_import_on_the_gpu_image():
    """A test module under tests/offload_core importing a service library, or the suite's xdist hook
    refused without xdist, would stop every CUDA test there at collection ("no tests ran"); a sub-bench
    importing one would lose its figures."""
    done = subprocess.run([sys.executable, "-c", COLLECT], cwd=REPO, capture_output=True, text=True, timeout=180)
    output = done.stdout + done.stderr
    assert done.returncode == 0 and "INTERNALERROR" not in output, output[-3000:]
    counts = [int(line.rsplit(": ", 1)[1]) for line in done.stdout.splitlines() if line.startswith("tests/")]
    assert sum(counts) >= 40, output[-3000:]
