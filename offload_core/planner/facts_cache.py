"""Real-size component profiles, kept on disk so planning again builds nothing.

A component comes from its committed skeleton (offload_core/planner/skeletons.py) or, without
one, from its library, whose import takes 3-8 s (diffusers pulls in torch._dynamo; measured in
bench/plan_speed.py); laying out its layers is another 0.1-0.3 s. A profile (layer keys, the engine's layouts, bytes,
parameter counts) is a pure function of the component's class, config, dtype, layer groups and
table rule, of the library versions that build it and of the layout code that reads it, so it is
cached under a digest of all of those: any change makes a new entry, never a stale hit.

Files live in ``$OFFLOAD_SERVE_CACHE/plan-facts`` (default ``~/.cache/offload-serve/plan-facts``),
written by this user only (a pickle is code: the folder is created 0700 and a file another user
owns is never read). Set ``OFFLOAD_SERVE_PLAN_CACHE=0`` to build every time. Runs in whichever
process plans: the CLI, a stage replica.
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import os
import pickle
import tempfile
from pathlib import Path
from typing import Any, Callable, Mapping

import torch

from offload_core.planner.facts import ComponentProfile

logger = logging.getLogger(__name__)

# The code a profile (and the notes cached with it) is computed by: an edit to any of these is a new
# digest. Every module a build runs is here (tests/offload_core/planner/test_facts_cache.py traces one).
_SOURCES = ("layout.py", "order.py", "tables.py", "quant.py", "planner/facts.py", "planner/inputs.py",
            "planner/real_models.py", "planner/facts_cache.py", "planner/skeletons.py", "tensor_parallel/sharded.py")
_ROOT = Path(__file__).resolve().parents[1]
# And the data a build reads beside its key: the committed skeletons (planner/skeletons.py), from the repository root.
_DATA = ("configs/models/real_model_skeletons.json",)
_LIBRARIES = ("torch", "diffusers", "transformers")


def cache_dir() -> Path | None:
    """Where profiles are kept, or None when caching is off."""
    if os.environ.get("OFFLOAD_SERVE_PLAN_CACHE", "1") == "0":
        return None
    base = os.environ.get("OFFLOAD_SERVE_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "offload-serve")
    return Path(base) / "plan-facts"


def _code_digest() -> str:
    h = hashlib.sha256()
    for name in _SOURCES:
        h.update(name.encode())
        h.update((_ROOT / name).read_bytes())
    for name in _DATA:
        h.update(name.encode())
        h.update((_ROOT.parent / name).read_bytes())
    for library in _LIBRARIES:
        try:
            h.update(f"{library}={importlib.metadata.version(library)}".encode())
        except importlib.metadata.PackageNotFoundError:
            h.update(f"{library}=absent".encode())
    return h.hexdigest()


def profile_key(name: str, class_name: str, config: Mapping[str, Any], dtype: torch.dtype,
                groups: tuple[str, ...] | None, uses: int, tables: object) -> str:
    """The digest a profile is filed under: everything it is computed from."""
    what = json.dumps({"name": name, "class": class_name, "config": dict(config), "dtype": str(dtype),
                       "groups": groups, "uses": uses, "tables": repr(tables)}, sort_keys=True, default=str)
    return hashlib.sha256((_code_digest() + what).encode()).hexdigest()[:32]


def cached_profile(key: str, build: Callable[[], tuple[ComponentProfile, list[str]]]
                   ) -> tuple[ComponentProfile, list[str]]:
    """The profile (and the notes made building it) filed under ``key``, built and filed if absent."""
    folder = cache_dir()
    path = folder / f"{key}.pickle" if folder is not None else None
    if path is not None and path.is_file() and path.stat().st_uid == os.getuid():
        try:
            with open(path, "rb") as f:
                profile, notes = pickle.load(f)
            if isinstance(profile, ComponentProfile):
                return profile, list(notes)
        except (OSError, pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError) as error:
            logger.info("plan facts cache: %s unreadable (%s): building again", path, error)
    profile, notes = build()
    if path is not None:
        _write(path, (profile, notes))
    return profile, notes


def _write(path: Path, value: object) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        handle, temp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
        with os.fdopen(handle, "wb") as f:
            pickle.dump(value, f, protocol=pickle.HIGHEST_PROTOCOL)
        os.replace(temp, path)  # readers see the whole file or none
    except OSError as error:  # a read-only home: planning still works, only slower next time
        logger.info("plan facts cache: not written to %s (%s)", path.parent, error)
