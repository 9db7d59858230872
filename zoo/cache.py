"""Build-once cache folders: a file lock, a temp folder, an atomic rename and a recipe stamp.

Several processes (pytest workers, Ray replicas, benchmarks) may ask for the same model at once.
The first takes the lock and builds into a temp folder beside the target; the rest wait on the
lock and then find the stamp. Readers that find a matching stamp never take the lock, so a warm
cache costs one small file read.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path

from filelock import FileLock

logger = logging.getLogger(__name__)

# Written last into a finished folder; its content is the recipe, so a changed recipe rebuilds.
STAMP_NAME = "zoo_stamp.json"


def stamp_text(spec: Mapping[str, object]) -> str:
    """The canonical stamp for a recipe spec (sorted keys, so equal specs give equal text)."""
    return json.dumps(dict(spec), sort_keys=True, indent=1)


def is_current(folder: Path, spec: Mapping[str, object]) -> bool:
    """True when ``folder`` was finished by a build of exactly this recipe spec."""
    stamp = folder / STAMP_NAME
    return stamp.is_file() and stamp.read_text() == stamp_text(spec)


def ensure_built(root: Path, name: str, spec: Mapping[str, object], build: Callable[[Path], None]) -> Path:
    """Return ``root/name``, building it with ``build(temp_folder)`` unless a matching stamp is there.

    ``build`` fills an empty folder; it is published with one rename, so no reader ever sees a
    half-written model. A stale folder (other recipe) is moved aside and deleted after the swap.
    """
    final = root / name
    if is_current(final, spec):
        return final
    with FileLock(str(root / f".{name}.lock")):
        if is_current(final, spec):  # another process finished it while we waited for the lock
            logger.info("zoo: %s was built by another process while waiting; reusing %s", name, final)
            return final
        _remove_leftovers(root, name)
        reason = "stale recipe stamp" if final.exists() else "not built yet"
        logger.info("zoo: building %s into %s (%s)", name, final, reason)
        started = time.perf_counter()
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}.building-", dir=root))
        tmp.chmod(0o755)  # mkdtemp makes it 0700; other users (Ray workers, CI) read the cache too
        try:
            build(tmp)
            (tmp / STAMP_NAME).write_text(stamp_text(spec))
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        old = None
        if final.exists():
            old = root / f".{name}.old-{uuid.uuid4().hex}"
            os.rename(final, old)
        os.rename(tmp, final)
        if old is not None:
            shutil.rmtree(old)
        size = sum(p.stat().st_size for p in final.rglob("*") if p.is_file())
        logger.info("zoo: built %s in %.1f s, %.1f MB on disk", name, time.perf_counter() - started, size / 1e6)
    return final


def _remove_leftovers(root: Path, name: str) -> None:
    """Delete temp and old folders a killed builder left behind (only called with the lock held,
    so no live builder of ``name`` owns them); a medium model leaves ~340 MB each time."""
    for leftover in (*root.glob(f".{name}.building-*"), *root.glob(f".{name}.old-*")):
        logger.info("zoo: removing %s left by an interrupted build", leftover)
        shutil.rmtree(leftover, ignore_errors=True)
