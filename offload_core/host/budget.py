"""The lease-based memory budget: one interface, and the in-process ledger that implements it.

Host memory (and, in the cluster, a shared GPU's memory) is spent through explicit leases:
``request`` returns a :class:`Lease` or a :class:`Refusal` saying why, and ``release`` gives it
back. Nothing is returned by garbage collection: a lease that is not released stays charged.

The engine only ever sees :class:`MemoryBudget`; the per-node Ray actor in ``cluster/ledger/actor.py``
implements the same interface, so an engine never knows whether its budget is local or shared.
"""
from __future__ import annotations

import itertools
import logging
import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Lease:
    """Bytes granted to one owner until it releases them."""

    lease_id: str
    owner: str
    nbytes: int
    # Higher means the bytes pay more (weight bytes x uses per request); ledgers may use it to
    # decide who waits when the pool is contended. Recorded on the lease for reports.
    priority: float = 0.0
    # What the bytes are for, for reports and logs ("pinned:transformer", "gpu-working-set").
    purpose: str = ""
    # A reservation kept between uses: the ledger may ask for it back (a recall) when another
    # owner needs the bytes; the holder gives it back once no call of its own is using it.
    recallable: bool = False


@dataclass(frozen=True)
class Refusal:
    """A request that could not be granted, with the numbers that decided it."""

    owner: str
    nbytes: int
    available: int
    reason: str

    def __bool__(self) -> bool:  # a refusal is falsy so `if lease := budget.request(...)` reads well
        return False


class MemoryBudget(ABC):
    """A pool of bytes handed out as explicit leases. Implementations must be thread-safe."""

    @abstractmethod
    def request(self, nbytes: int, owner: str, priority: float = 0.0, purpose: str = "") -> Lease | Refusal:
        """Grant ``nbytes`` to ``owner`` if they fit now, else say why not. Never over-commits."""

    @abstractmethod
    def release(self, lease: Lease) -> None:
        """Give a lease back. Releasing an unknown or already released lease raises KeyError."""

    @abstractmethod
    def outstanding(self, owner: str | None = None) -> tuple[Lease, ...]:
        """Leases not yet released, for one owner or for all."""

    @abstractmethod
    def capacity(self) -> int:
        """Total bytes this budget may hand out."""

    def leased(self) -> int:
        return sum(lease.nbytes for lease in self.outstanding())

    def available(self) -> int:
        return self.capacity() - self.leased()

    def release_owner(self, owner: str) -> int:
        """Release every lease of ``owner``; returns the bytes given back."""
        freed = 0
        for lease in self.outstanding(owner):
            self.release(lease)
            freed += lease.nbytes
        return freed


class InProcessLedger(MemoryBudget):
    """A budget of fixed capacity shared by the threads of one process."""

    def __init__(self, capacity_bytes: int, name: str = "host"):
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0, got {capacity_bytes}")
        self._capacity = int(capacity_bytes)
        self._name = name
        self._leases: dict[str, Lease] = {}
        self._ids = itertools.count(1)
        self._lock = threading.Lock()

    def request(self, nbytes: int, owner: str, priority: float = 0.0, purpose: str = "") -> Lease | Refusal:
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        with self._lock:
            available = self._capacity - sum(l.nbytes for l in self._leases.values())
            if nbytes > available:
                refusal = Refusal(owner, nbytes, available,
                                  f"{self._name}: {nbytes} B asked, {available} B of {self._capacity} B free")
                logger.info("budget %s refused %d B to %s: only %d B free", self._name, nbytes, owner, available)
                return refusal
            lease = Lease(f"{self._name}-{next(self._ids)}", owner, int(nbytes), float(priority), purpose)
            self._leases[lease.lease_id] = lease
            return lease

    def release(self, lease: Lease) -> None:
        with self._lock:
            if self._leases.pop(lease.lease_id, None) is None:
                raise KeyError(f"lease {lease.lease_id} of {lease.owner} is not outstanding")

    def outstanding(self, owner: str | None = None) -> tuple[Lease, ...]:
        with self._lock:
            return tuple(l for l in self._leases.values() if owner is None or l.owner == owner)

    def release_owner(self, owner: str) -> int:
        """Every lease of ``owner`` at once: a lease another thread gives back meanwhile is not
        released twice (the base class's walk of :meth:`outstanding` then :meth:`release` raced so)."""
        return sum(lease.nbytes for lease in self.take_owner(owner))

    def take_owner(self, owner: str) -> tuple[Lease, ...]:
        """Release and return every lease of ``owner``, under one hold of the lock."""
        with self._lock:
            taken = tuple(l for l in self._leases.values() if l.owner == owner)
            for lease in taken:
                del self._leases[lease.lease_id]
            return taken

    def capacity(self) -> int:
        return self._capacity
