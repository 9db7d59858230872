"""Neighbours' outstanding leases on one GPU: what the device's headroom must leave alone.

The node ledger knows what every process on the node leased of a GPU's pool; the driver's free
memory already excludes what those processes hold. What a neighbour leased and has not allocated
yet is in neither: counting it as free takes bytes from under the neighbour's next allocation.
So the replica gives its ``offload_core`` device a provider (``Device.set_neighbours``) answering
"bytes other processes leased here and do not hold yet":

- on a real GPU, per neighbour process: leased minus what NVML says it uses
  (``nvmlDeviceGetComputeRunningProcesses``; its own CUDA context included, so a neighbour that
  holds more than it leased counts 0, never less). Where NVML's pids are not this container's
  (a PID namespace: none of the node's lease pids appear), the neighbours are taken together:
  their leases minus what every other process on the GPU uses.
- on a fake GPU (a CPU standing in for a GPU, tests and CPU-only nodes) nothing a neighbour holds
  is in this process's headroom: all of its lease counts.

The figure is refreshed off the hot path, by the ledger client's heartbeat (every
``LedgerConfig.heartbeat_s``, 2 s: the one round trip it made anyway, now also carrying the
pool's leases per process) and once when the replica starts watching; reading it is one attribute,
so no decision pays a ledger round trip. A grant made since the last beat is missed for at most
one heartbeat; the ledger's own accounting (every call leases before it allocates) stays the
guard that never over-commits.
"""
from __future__ import annotations

import logging
import os
import threading
from typing import Callable, Mapping

from cluster.node import GpuInfo

logger = logging.getLogger(__name__)

# (pid, bytes leased) per process holding leases in one pool, as the ledger's pulse reports it.
LeasedByProcess = tuple[tuple[int, int], ...]
# pid -> bytes that process uses on the GPU now (NVML); None: not a real GPU.
UsedByProcess = Callable[[], Mapping[int, int]]


class NeighbourLeases:
    """Bytes other processes leased on one GPU and do not hold yet; a ``Device.set_neighbours`` provider."""

    def __init__(self, pool: str, used_by_process: UsedByProcess | None, pid: int | None = None):
        self.pool = pool
        self._used = used_by_process  # None: a fake GPU, nothing of a neighbour is visible here
        self._pid = os.getpid() if pid is None else pid
        self._lock = threading.Lock()
        self._outstanding = 0
        self.leased = 0  # neighbours' leases in the pool at the last refresh
        self.held = 0  # of them, what NVML saw the neighbours use
        self._aggregate_said = False
        self._closed = False

    def __call__(self) -> int:
        return self._outstanding

    def close(self) -> None:
        """The replica is gone: no figure comes any more, so none is claimed (the device may outlive it)."""
        self._used, self._closed = None, True
        with self._lock:
            self._outstanding = self.leased = self.held = 0

    def refresh(self, leased_by_process: LeasedByProcess) -> int:
        """Recompute from the ledger's figures (and NVML's, on a real GPU); returns the new figure."""
        if self._closed:
            return 0
        others = {pid: nbytes for pid, nbytes in leased_by_process if pid != self._pid and nbytes > 0}
        used = dict(self._used()) if self._used is not None and others else {}
        matched = [pid for pid in others if pid in used]
        if used and not matched and self._pid not in used:
            # NVML's pids are the host's, not this PID namespace's: take the neighbours together.
            held = min(sum(others.values()), sum(used.values()))
            if not self._aggregate_said:
                self._aggregate_said = True
                logger.info("%s: NVML's process ids are not this container's; neighbours' held bytes taken "
                            "together (%d B used by %d processes)", self.pool, sum(used.values()), len(used))
            outstanding = max(0, sum(others.values()) - held)
        else:
            held = sum(min(nbytes, used.get(pid, 0)) for pid, nbytes in others.items())
            outstanding = sum(max(0, nbytes - used.get(pid, 0)) for pid, nbytes in others.items())
        with self._lock:
            changed = outstanding != self._outstanding
            self._outstanding, self.leased, self.held = outstanding, sum(others.values()), held
        if changed:
            logger.debug("%s: neighbours' outstanding leases %d B (%d B leased by %d processes, %d B of it held)",
                         self.pool, outstanding, self.leased, len(others), held)
        return outstanding


def nvml_used_by_process(gpu: GpuInfo, nvml=None) -> UsedByProcess:
    """pid -> bytes used on ``gpu`` now, from NVML (``nvml`` injectable for tests, default pynvml)."""
    if nvml is None:
        import pynvml as nvml

    def used() -> dict[int, int]:
        nvml.nvmlInit()
        try:
            if gpu.uuid is not None:
                handle = nvml.nvmlDeviceGetHandleByUUID(gpu.uuid)
            else:
                handle = nvml.nvmlDeviceGetHandleByIndex(gpu.index)
            # usedGpuMemory is None where the driver cannot tell (some vGPU and Windows set-ups).
            return {int(p.pid): int(p.usedGpuMemory or 0) for p in nvml.nvmlDeviceGetComputeRunningProcesses(handle)}
        finally:
            nvml.nvmlShutdown()

    return used


def neighbour_leases(pool: str, gpu: GpuInfo | None) -> NeighbourLeases | None:
    """The provider for a replica leasing ``pool`` of ``gpu``; None without a GPU pool."""
    if gpu is None:
        return None
    real = gpu.source.startswith("nvml")
    return NeighbourLeases(pool, nvml_used_by_process(gpu) if real else None)
