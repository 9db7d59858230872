"""Who a rank of a tensor-parallel stage replica is, and where it landed (deployments/replica/tensor_parallel/group.py).

Plain data, read by the stage worker (a rank's leases, plan and report are its own) and by the
replica's shard group.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RankSpec:
    """Who a rank worker is: its rank, the group's size and the replica it belongs to."""

    rank: int
    size: int
    replica: str  # the Serve replica's id

    @property
    def worker_id(self) -> str:
        """The rank's own id: its leases, its residency report and its actor's name."""
        return f"{self.replica}/rank{self.rank}"


@dataclass(frozen=True)
class RankIdentity:
    """Where a rank actor landed."""

    rank: int
    node_ip: str
    pid: int
    gpu_uuid: str | None  # None on a CPU bundle
