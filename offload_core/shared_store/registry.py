"""Who creates a node weight store, who is attached to it, and the one lease that pays for it.

A shared copy is leased once, not once per replica: the first replica to ask gets the CREATE role
and the lease is taken for the whole copy; later replicas get ATTACH and lease nothing more. The
lease goes back when the last replica detaches. A replica is admitted only if its own budget
could hold the whole copy should the others leave (else the copy would outlive what its last
replica may hold). :class:`InProcessStoreRegistry` does this for one process;
``cluster/ledger/shared_stores.py`` does it node-wide through the node ledger, with dead replicas
detached by the ledger's liveness checks.
"""
from __future__ import annotations

import logging
import threading
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path

from offload_core.host.budget import Lease, MemoryBudget, Refusal
from offload_core.shared_store.files import StoreKey, StoreRole, remove_store

logger = logging.getLogger(__name__)

# How long a replica waits for another replica to finish writing a store before giving up: a
# 26 GiB copy of Wan2.1-14B's layers written at ~2 GB/s from a cold disk takes ~15 s; 600 s is
# the Serve replica start timeout's order of magnitude.
CREATE_WAIT_S = 600.0


@dataclass(frozen=True)
class StoreTicket:
    """A replica's admission to a store: create it, or attach to the finished one."""

    role: StoreRole
    attached: int  # replicas attached now, this one included


@dataclass(frozen=True)
class StoreAttachment:
    """One store as the report shows it: its size and how many replicas share it."""

    digest: str
    component: str
    nbytes: int
    attached: int

    @property
    def share_bytes(self) -> int:
        return self.nbytes // max(1, self.attached)

    def to_json(self) -> dict:
        return {"store": self.digest, "component": self.component, "bytes": self.nbytes,
                "attached": self.attached, "share_bytes": self.share_bytes}


def admission_refusal(owner: str, nbytes: int, budget_bytes: int | None) -> Refusal | None:
    """Refuse a replica whose budget could not hold the whole copy on its own."""
    if budget_bytes is None or budget_bytes >= nbytes:
        return None
    return Refusal(owner, nbytes, budget_bytes,
                   f"its host budget of {budget_bytes} B could not hold the whole {nbytes} B shared copy "
                   "should the other replicas leave")


class StoreRegistry(ABC):
    """Node-wide bookkeeping of weight stores. Implementations must be thread-safe."""

    @abstractmethod
    def acquire(self, key: StoreKey, nbytes: int, path: str, owner: str,
                budget_bytes: int | None = None) -> StoreTicket | Refusal:
        """Admit ``owner`` to the store of ``key``; waits (bounded) while another replica writes it."""

    @abstractmethod
    def ready(self, key: StoreKey, owner: str) -> None:
        """The creator finished writing: later replicas may attach."""

    @abstractmethod
    def release(self, key: StoreKey, owner: str) -> None:
        """Detach ``owner``; the last one out gives the lease back and the file is removed."""

    @abstractmethod
    def attachment(self, key: StoreKey) -> StoreAttachment | None:
        """The store's size and attached replicas now, or None when it is gone."""


@dataclass
class _Entry:
    key: StoreKey
    path: str
    lease: Lease
    owners: list  # one entry per attachment: two replicas of one owner name (in one process) count twice
    ready: bool = False


class InProcessStoreRegistry(StoreRegistry):
    """The registry of one process (no Ray): leases from ``budget``, one per store."""

    def __init__(self, budget: MemoryBudget):
        self._budget = budget
        self._entries: dict[str, _Entry] = {}
        self._changed = threading.Condition()

    def acquire(self, key, nbytes, path, owner, budget_bytes=None):
        if (refused := admission_refusal(owner, nbytes, budget_bytes)) is not None:
            return refused
        deadline = time.monotonic() + CREATE_WAIT_S
        with self._changed:
            while (entry := self._entries.get(key.digest)) is not None and not entry.ready:
                if not self._changed.wait(max(0.0, deadline - time.monotonic())):
                    return Refusal(owner, nbytes, 0, f"store {key.digest} still being written after {CREATE_WAIT_S} s")
            if entry is not None:
                entry.owners.append(owner)
                return StoreTicket(StoreRole.ATTACH, len(entry.owners))
            lease = self._budget.request(nbytes, f"store:{key.digest}", purpose=f"shared-weights:{key.component}")
            if not isinstance(lease, Lease):
                return lease
            self._entries[key.digest] = _Entry(key, path, lease, [owner])
            return StoreTicket(StoreRole.CREATE, 1)

    def ready(self, key, owner):
        with self._changed:
            self._entries[key.digest].ready = True
            self._changed.notify_all()

    def release(self, key, owner):
        with self._changed:
            entry = self._entries.get(key.digest)
            if entry is None or owner not in entry.owners:
                raise KeyError(f"{owner} is not attached to store {key.digest}")
            entry.owners.remove(owner)
            if not entry.owners:
                del self._entries[key.digest]
                self._budget.release(entry.lease)
                remove_store(Path(entry.path))
                logger.info("store %s: last replica (%s) detached; lease of %d B given back, file removed",
                            key.digest, owner, entry.lease.nbytes)
            self._changed.notify_all()

    def attachment(self, key):
        with self._changed:
            entry = self._entries.get(key.digest)
            if entry is None:
                return None
            return StoreAttachment(key.digest, key.component, entry.lease.nbytes, len(entry.owners))
