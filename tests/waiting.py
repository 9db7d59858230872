"""Polling for a condition in tests that drive real processes (Ray actors, Serve replicas)."""
from __future__ import annotations

import time
from typing import Callable, TypeVar

T = TypeVar("T")


def wait_for(predicate: Callable[[], T], timeout_s: float = 30.0, what: str = "condition", poll_s: float = 0.2) -> T:
    """The first truthy value ``predicate()`` returns within ``timeout_s``; else an AssertionError
    naming ``what``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll_s)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
