"""The replica's memory: the node's host budget and the device working set, from one seam.

``cluster.replica_memory.ReplicaMemory`` leases from the node's one ledger actor (and falls back
to an in-process ledger itself when Ray is not running). :func:`open_replica_memory` is the only
place the service opens it.
"""
from __future__ import annotations

import logging

import torch

from cluster import replica_memory

logger = logging.getLogger(__name__)


class DeviceBusy(RuntimeError):
    """The device working set was not granted within the bounded wait (HTTP 503 with Retry-After).

    The cluster's ``DeviceBusy`` is built from a ``Refusal``, which Ray cannot rebuild from the
    message alone when the error crosses to the ingress; this one pickles itself.
    """

    def __init__(self, owner: str, nbytes: int, available: int, waited_s: float, retry_after_s: int = 1):
        super().__init__(f"{owner}: device working set of {nbytes} B not granted after {waited_s:.1f} s "
                         f"({available} B free)")
        self.owner, self.nbytes, self.available = owner, nbytes, available
        self.waited_s, self.retry_after_s = waited_s, retry_after_s

    def __reduce__(self):
        return (DeviceBusy, (self.owner, self.nbytes, self.available, self.waited_s, self.retry_after_s))

    @classmethod
    def from_cluster(cls, exc: replica_memory.DeviceBusy) -> "DeviceBusy":
        return cls(exc.owner, exc.nbytes, exc.available, exc.waited_s, exc.retry_after_s)


def open_replica_memory(owner: str, device: torch.device) -> replica_memory.ReplicaMemory:
    """The node's shared host budget (``.host_budget``) and ``.device_working_set`` for one replica."""
    return replica_memory.ReplicaMemory.open(owner, device)


CLUSTER_DEVICE_BUSY = replica_memory.DeviceBusy
