"""The one reader of configs/models/real_model_configs.json: real models' configs, GPU and link facts.

Torch-free, so that the GPU table (:mod:`offload_core.planner.gpus`), and through it the node ledger
actor's node facts, read the file without importing torch (1.0 s of CPU on a quiet 2-core machine);
the meta-device models built from it are :mod:`offload_core.planner.real_models`'.

Run by ``offload-serve plan`` and by whichever process reads the GPU table.
"""
from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import Any

# Found from this file (offload_core/planner/config_file.py), not from zoo: offload_core imports no sibling package.
CONFIG_PATH = Path(__file__).resolve().parents[2] / "configs" / "models" / "real_model_configs.json"


class UnknownModel(KeyError):
    """A model, component or GPU name that the real-model config file does not describe."""


@lru_cache(maxsize=1)
def config_file() -> dict[str, Any]:
    """The parsed config file (read once)."""
    with open(CONFIG_PATH) as f:
        return json.load(f)
