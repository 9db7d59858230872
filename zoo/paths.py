"""Where the tiny zoo lives on disk: one cache folder outside git, shared by every process."""
from __future__ import annotations

import os
from pathlib import Path

# The repository root is two levels up from this file (zoo/paths.py); .cache/ is git-ignored.
_REPO_ROOT = Path(__file__).resolve().parent.parent
ZOO_ENV = "OFFLOAD_SERVE_ZOO"


def zoo_root() -> Path:
    """The cache folder for built zoo models: $OFFLOAD_SERVE_ZOO, else <repo>/.cache/zoo.

    The folder is created on demand; callers get an absolute path.
    """
    configured = os.environ.get(ZOO_ENV)
    root = Path(configured).expanduser() if configured else _REPO_ROOT / ".cache" / "zoo"
    root = root.resolve()
    root.mkdir(parents=True, exist_ok=True)
    return root

