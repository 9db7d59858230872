"""The replica's memory: one function returning the node's host budget and the device working set.

The cluster engineer's ``cluster.replica_memory.ReplicaMemory`` is the real thing (a per-node
ledger actor shared by every replica on the node). :func:`open_replica_memory` is the single seam:
when that module is not installed it returns :class:`LocalReplicaMemory`, an in-process ledger
with the same surface, and says so in one log line.
"""
from __future__ import annotations

import contextlib
import importlib
import logging
import time
from typing import Iterator

import torch

from offload_core.budget import InProcessLedger, Lease, MemoryBudget

logger = logging.getLogger(__name__)

# Between two tries for a contended device lease: long enough not to spin a core, short against
# a tiny-model stage call (~50 ms).
_POLL_S = 0.02


class DeviceBusy(RuntimeError):
    """The device working set could not be leased within the bounded wait (HTTP 503, Retry-After)."""

    def __init__(self, owner: str, nbytes: int, available: int, waited_s: float):
        super().__init__(f"{owner}: device working set of {nbytes} B not available after {waited_s:.1f} s "
                         f"({available} B free)")
        self.owner, self.nbytes, self.available, self.waited_s = owner, nbytes, available, waited_s

    def __reduce__(self):  # crosses Ray's boundary as itself, so the ingress can map it to 503
        return (DeviceBusy, (self.owner, self.nbytes, self.available, self.waited_s))


def _device_capacity(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[1])
    from offload_core.host_memory import host_ram_available

    return host_ram_available().spendable  # a CPU "device" holds what host RAM can


class LocalReplicaMemory:
    """In-process stand-in for ``cluster.replica_memory.ReplicaMemory`` (same public surface)."""

    def __init__(self, owner: str, device: torch.device):
        from offload_core.host_memory import host_ram_available

        self.owner = owner
        self.host_budget: MemoryBudget = InProcessLedger(host_ram_available().spendable, name=f"host:{owner}")
        self.device_budget: MemoryBudget = InProcessLedger(_device_capacity(device), name=f"device:{owner}")

    @contextlib.contextmanager
    def device_working_set(self, nbytes: int, timeout_s: float) -> Iterator[Lease]:
        start = time.monotonic()
        while not (lease := self.device_budget.request(nbytes, self.owner, purpose="gpu-working-set")):
            waited = time.monotonic() - start
            if waited >= timeout_s:
                raise DeviceBusy(self.owner, nbytes, lease.available, waited)
            time.sleep(_POLL_S)
        try:
            yield lease
        finally:
            self.device_budget.release(lease)


def busy_error_types() -> tuple[type[BaseException], ...]:
    """Every exception type meaning "device busy, retry later", whichever memory is installed."""
    types: list[type[BaseException]] = [DeviceBusy]
    cluster_busy = getattr(_cluster_module(), "DeviceBusy", None)
    if cluster_busy is not None:
        types.append(cluster_busy)
    return tuple(types)


def _cluster_module():
    try:
        return importlib.import_module("cluster.replica_memory")
    except ModuleNotFoundError as exc:
        if exc.name != "cluster.replica_memory":
            raise
        return None


def open_replica_memory(owner: str, device: torch.device):
    """The node's shared host budget and the device working-set lease for one stage replica."""
    module = _cluster_module()
    if module is None:
        logger.info("replica memory for %s: cluster.replica_memory not installed, using an in-process "
                    "ledger (budgets are not shared with other replicas on this node)", owner)
        return LocalReplicaMemory(owner, device)
    memory = module.ReplicaMemory.open(owner, device)
    logger.info("replica memory for %s: node ledger via cluster.replica_memory", owner)
    return memory
