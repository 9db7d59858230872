"""The one reader of configs/models/real_model_configs.json: real models' configs, GPU and link facts.

Torch-free, so that the GPU table (:mod:`offload_core.planner.gpus`), and through it the node ledger
actor's node facts, read the file without importing torch (1.0 s of CPU on a quiet 2-core machine);
the meta-device models built from it are :mod:`offload_core.planner.real_models`'.

Run by ``offload-serve plan`` and by whichever process reads the GPU table.
"""
from __future__ import annotations

import difflib
import json
from functools import lru_cache
from pathlib import Path
from typing import Any, Sequence

# Found from this file (offload_core/planner/config_file.py), not from zoo: offload_core imports no sibling package.
CONFIG_PATH = Path(__file__).resolve().parents[2] / "configs" / "models" / "real_model_configs.json"


class UnknownModel(KeyError):
    """A model, component or GPU name that the real-model config file does not describe."""


def resolve_name(name: str, names: Sequence[str], kind: str) -> str:
    """``name`` as the file spells it: itself, or the one of ``names`` equal to it but for case
    ("l4", "FLUX.1-dev"); else :class:`UnknownModel` naming the likeliest ("4090": RTX4090) and all."""
    if name in names:
        return name
    same = [n for n in names if n.casefold() == name.casefold()]
    if len(same) == 1:
        return same[0]
    folded = {n.casefold(): n for n in names}
    likely = [n for n in names if name.casefold() in n.casefold()] or \
        [folded[n] for n in difflib.get_close_matches(name.casefold(), list(folded), n=3, cutoff=0.8)]
    hint = f"; did you mean {' or '.join(likely[:3])}?" if likely else ";"
    raise UnknownModel(f"unknown {kind} {name!r}{hint} known: {', '.join(names)}")


@lru_cache(maxsize=1)
def config_file() -> dict[str, Any]:
    """The parsed config file (read once)."""
    with open(CONFIG_PATH) as f:
        return json.load(f)
