"""offload_core imports with torch alone: a GPU image with CUDA torch but none of the service's libraries runs it."""
from __future__ import annotations

import subprocess
import sys

BLOCK = """
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in {'pydantic', 'tenacity', 'ray', 'fastapi', 'starlette'}:
            raise ImportError(f'{name} is not installed on this image')
sys.meta_path.insert(0, Block())
import offload_core, offload_core.residency.lifecycle, offload_core.streaming.engine, offload_core.planner.cli
import offload_core.lora
from offload_core.host.budget_cap import CappedBudget
print('ok')
"""


def test_the_engine_and_the_planner_import_without_the_services_libraries():
    done = subprocess.run([sys.executable, "-c", BLOCK], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]
