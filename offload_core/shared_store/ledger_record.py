"""The node ledger's record of its weight stores: one lease per shared copy, with its attached replicas.

The node ledger (``cluster/ledger/actor.py``) keeps a :class:`SharedStores` beside its pools and calls
in here for every store request. A store's bytes are ONE lease of the host pool, held under the
ledger's own process (so no replica's death takes it); the replicas attached to it are listed with
it. The first replica to ask writes the copy (CREATE); later ones wait while it is written, then
ATTACH. The lease goes back and the shared-memory file is removed when the last replica detaches, or
when the liveness checks find every attached replica dead. A replica is admitted only if its own
budget could hold the whole copy should the others leave.

Pure Python: the ledger's pools and its owners' process references come in through the two
Protocols below. Run by the node ledger's actor.
"""
from __future__ import annotations

import enum
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Hashable, Protocol

from offload_core.host.budget import Lease, Refusal
from offload_core.shared_store.files import StoreRole, is_store_file, remove_store
from offload_core.shared_store.registry import StoreAttachment, StoreTicket, admission_refusal

logger = logging.getLogger(__name__)


class Owner(Hashable, Protocol):
    """The process behind a lease owner (the ledger's ``OwnerRef``): hashable, with the owner's name."""

    owner: str


class LeasePool(Protocol):
    """What the record asks of the ledger's pools (``cluster/ledger/pools.py``)."""

    async def request(self, pool: str, nbytes: int, ref: Owner, *, owner: str, purpose: str) -> Lease | Refusal: ...

    def release(self, pool: str, lease_id: str) -> object: ...

    def readopt(self, leases, ref: Owner) -> object: ...


class StoreStatus(enum.Enum):
    WRITING = "writing"  # its creator is copying the layers in; attachers wait
    READY = "ready"  # complete: later replicas map it


@dataclass(frozen=True)
class StoreWait:
    """Another replica is still writing the store: ask again shortly."""

    digest: str


@dataclass(frozen=True)
class StoreState:
    """One store as the ledger's report shows it."""

    digest: str
    component: str
    path: str
    nbytes: int
    status: StoreStatus
    attached: tuple[str, ...]  # owner names
    lease_id: str


@dataclass(eq=False)
class _Store:
    digest: str
    component: str
    path: str
    lease: Lease
    creator: Owner
    # Owner -> its attachments' budgets (None: unset); a process holding two replicas of one
    # owner name attaches twice and stays attached until both detach.
    attached: dict = field(default_factory=dict)
    status: StoreStatus = StoreStatus.WRITING


class SharedStores:
    """The stores of one node, their leases in ``pools`` under ``ref`` (the ledger's process)."""

    def __init__(self, pools: LeasePool, pool: str, ref: Owner, label: str = "ledger"):
        self._pools, self._pool, self._ref, self._label = pools, pool, ref, label
        self._stores: dict[str, _Store] = {}

    async def attach(self, digest: str, component: str, path: str, nbytes: int, ref: Owner,
                     budget_bytes: int | None) -> StoreTicket | StoreWait | Refusal:
        if not is_store_file(Path(path)):
            raise ValueError(f"{path!r} is not a store file name; the ledger removes only its own files")
        if (refused := admission_refusal(ref.owner, nbytes, budget_bytes)) is not None:
            logger.info("%s: %s not admitted to store %s: %s", self._label, ref.owner, digest, refused.reason)
            return refused
        store = self._stores.get(digest)
        if store is None:
            lease = await self._pools.request(self._pool, nbytes, self._ref, owner=f"store:{digest}",
                                              purpose=f"shared-weights:{component}")
            if not isinstance(lease, Lease):
                return lease
            self._stores[digest] = _Store(digest, component, path, lease, ref, {ref: [budget_bytes]})
            logger.info("%s: store %s (%s, %d B) leased once; %s writes it", self._label, digest, component,
                        nbytes, ref.owner)
            return StoreTicket(StoreRole.CREATE, 1)
        if store.status is StoreStatus.WRITING:
            # The creator's own retried call (its first attempt may have run) is still the creator.
            return StoreTicket(StoreRole.CREATE, 1) if store.creator == ref else StoreWait(digest)
        store.attached.setdefault(ref, []).append(budget_bytes)
        n = _count(store)
        logger.info("%s: %s attached to store %s (%d replicas now, %d B each share)", self._label, ref.owner,
                    digest, n, store.lease.nbytes // n)
        return StoreTicket(StoreRole.ATTACH, n)

    def ready(self, digest: str, ref: Owner) -> None:
        store = self._stores[digest]
        if store.creator != ref:
            raise KeyError(f"{ref.owner} did not create store {digest}")
        store.status = StoreStatus.READY

    def detach(self, digest: str, ref: Owner, why: str = "detached") -> None:
        store = self._stores.get(digest)
        if store is None or not store.attached.get(ref):
            raise KeyError(f"{ref.owner} is not attached to store {digest}")
        store.attached[ref].pop()
        if not store.attached[ref] or why != "detached":  # a dead process takes all its attachments
            del store.attached[ref]
        if store.attached:
            logger.info("%s: %s left store %s (%s); %d replica(s) still attached", self._label, ref.owner,
                        digest, why, len(store.attached))
            return
        del self._stores[digest]
        self._pools.release(self._pool, store.lease.lease_id)
        remove_store(Path(store.path))
        logger.info("%s: store %s: last replica %s left (%s); %d B lease given back, %s removed", self._label,
                    digest, ref.owner, why, store.lease.nbytes, store.path)

    def readopt(self, digest: str, component: str, path: str, nbytes: int, ref: Owner,
                budget_bytes: int | None) -> None:
        """After a ledger restart: a replica says it maps this (finished) store; the bytes are held."""
        store = self._stores.get(digest)
        if store is None:
            # A fixed id: every replica re-registering this store names the same one lease.
            lease = Lease(f"{self._pool}-store-{digest}", f"store:{digest}", nbytes, 0.0, f"shared-weights:{component}")
            self._pools.readopt(((self._pool, lease),), self._ref)
            store = self._stores[digest] = _Store(digest, component, path, lease, ref, status=StoreStatus.READY)
        store.attached.setdefault(ref, []).append(budget_bytes)

    def reclaim(self, ref: Owner, why: str) -> int:
        """Detach a dead replica from every store it was attached to; returns the stores it left."""
        left = [digest for digest, store in self._stores.items() if ref in store.attached]
        for digest in left:
            self.detach(digest, ref, why)
        return len(left)

    def owners(self) -> set[Owner]:
        return {ref for store in self._stores.values() for ref in store.attached}

    def attachment(self, digest: str) -> StoreAttachment | None:
        store = self._stores.get(digest)
        if store is None:
            return None
        return StoreAttachment(digest, store.component, store.lease.nbytes, _count(store))

    def states(self) -> tuple[StoreState, ...]:
        return tuple(StoreState(s.digest, s.component, s.path, s.lease.nbytes, s.status,
                                tuple(sorted(r.owner for r in s.attached)), s.lease.lease_id)
                     for s in self._stores.values())


def _count(store: _Store) -> int:
    return sum(len(budgets) for budgets in store.attached.values())
