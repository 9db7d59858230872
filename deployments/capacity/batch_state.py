"""A batching replica's batch size, as the stage replica sends it to the residency board on its own.

Its own torch-free module: the board's process unpickles it, and everything else of a replica's
report (:mod:`deployments.capacity.replica_report`) imports torch (1.1 s of CPU at the board's start).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BatchState:
    """A batching replica's batch right now: requests in the running forward, and the mean so far."""

    size: int
    mean: float
    max: int

    def to_json(self) -> dict:
        return {"size": self.size, "mean": round(self.mean, 3), "max": self.max}
