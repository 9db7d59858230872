"""The node weight store's files by name: where they live, what they are called, and their removal.

Torch-free, so that the node ledger actor (which names, counts and sweeps store files but never
maps one) starts without torch: importing :mod:`offload_core.shared_store.store` costs 1.0 s of CPU on a
quiet 2-core machine for the torch import alone. The store itself (write, map, check) is
:mod:`offload_core.shared_store.store`; liveness is the ``flock`` each holder keeps on its file.
"""
from __future__ import annotations

import enum
import fcntl
import hashlib
import logging
import os
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

STORE_DIR_ENV = "OFFLOAD_SERVE_STORE_DIR"
DEFAULT_STORE_DIR = "/dev/shm/offload-serve"
PREFIX, SUFFIX = "offload-serve-", ".weights"


class StoreRole(enum.Enum):
    # The first replica on the node to need the copy: it writes the store, then maps it read-only.
    CREATE = "create"
    # A later replica: it maps the finished store and reads no checkpoint bytes for its layers.
    ATTACH = "attach"


def store_dir() -> Path:
    return Path(os.environ.get(STORE_DIR_ENV, DEFAULT_STORE_DIR))


def folder_identity(folder: str | os.PathLike) -> str:
    """What a model folder is: its real path and every file's name, size and mtime (no bytes read)."""
    root = Path(folder).resolve()
    h = hashlib.sha256(str(root).encode())
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        st = path.stat()
        h.update(f"\0{path.relative_to(root)}\0{st.st_size}\0{st.st_mtime_ns}".encode())
    return h.hexdigest()[:32]


@dataclass(frozen=True)
class StoreKey:
    """What a store holds: a model folder's component, in these dtypes, laid out this way."""

    model_identity: str  # folder_identity of the component's folder
    component: str
    dtype: str  # e.g. "float32" or "bfloat16+float32"
    layout_digest: str

    @property
    def digest(self) -> str:
        text = f"{self.model_identity}|{self.component}|{self.dtype}|{self.layout_digest}"
        return hashlib.sha256(text.encode()).hexdigest()[:24]

    @property
    def file_name(self) -> str:
        return f"{PREFIX}{self.digest}{SUFFIX}"


def unlink_quietly(path: Path) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        logger.info("store file %s was already gone", path)


def remove_if_unused(path: Path) -> bool:
    """Delete a store file (and its partial writes) if no live process holds it; True if removed."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return False
    try:
        unlink_quietly(path)
    finally:
        os.close(fd)
    return True


def remove_store(path: Path) -> None:
    """Delete a store file and any partial writes of it: its registry says no replica is attached.

    Processes still mapping it keep their pages (an unlinked file lives while mapped); new
    replicas find no file and create a fresh copy, which the registry then counts.
    """
    unlink_quietly(path)
    for partial in path.parent.glob(f"{path.name}.partial-*"):
        if remove_if_unused(partial):
            logger.info("store %s: removed its unfinished write %s", path.name, partial.name)


def is_store_file(path: Path) -> bool:
    name = path.name
    return name.startswith(PREFIX) and (name.endswith(SUFFIX) or f"{SUFFIX}.partial-" in name)


def sweep_orphans(directory: Path | None = None) -> tuple[str, ...]:
    """Remove store files no live process holds (left by crashed processes); returns their names."""
    directory = directory or store_dir()
    if not directory.is_dir():
        return ()
    removed = tuple(p.name for p in sorted(directory.iterdir()) if is_store_file(p) and remove_if_unused(p))
    if removed:
        logger.info("store sweep of %s: removed %d orphaned store file(s) no live process held: %s",
                    directory, len(removed), ", ".join(removed))
    return removed
