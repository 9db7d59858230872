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


def open_replica_memory(owner: str, device: torch.device) -> replica_memory.ReplicaMemory:
    """The node's shared host budget (``.host_budget``) and ``.device_working_set`` for one replica."""
    return replica_memory.ReplicaMemory.open(owner, device)

