"""The node ledger's accounting: pools of bytes, leases per owner process, bounded waits.

Pure asyncio, no Ray: the ledger actor (cluster/ledger/actor.py) runs one :class:`LeasePools` on its
one event loop. No ``await`` sits between "does it fit" and "record it", so concurrent requests
cannot over-commit a pool; the only awaits are a waiter's bounded sleep.

Waiting requests are served highest priority first (bytes x uses per request: a denoiser used 50
times per request outranks a decoder used once), then first come. A new request that fits still
queues behind a waiting one of equal or higher priority, or small requests would starve a big one.

Recallable leases are reservations a replica keeps between its calls (so back-to-back calls make
no round trip). When a request or a growth has to wait, the pool recalls other owners' idle
reservations, largest first, until the bytes it waits for are covered; each owner learns of it
through :meth:`LeasePools.recalls` and gives the lease back when no call of its own uses it. The
bytes stay leased until then, so a recall never lets two owners count on the same bytes.
"""
from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
from dataclasses import dataclass, field
from typing import Mapping

from cluster.ledger.liveness import OwnerRef
from offload_core.host.budget import Lease, Refusal

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PoolState:
    name: str
    capacity: int
    leased: int
    peak_leased: int  # the most ever leased at once since these pools were made
    leases: int
    waiters: int


@dataclass(eq=False)
class _Waiter:
    seq: int
    nbytes: int  # for a growth: the bytes added
    ref: OwnerRef
    owner: str
    priority: float
    purpose: str
    future: asyncio.Future
    recallable: bool = False
    grow: str | None = None  # the lease id this waiter grows; None: a new lease


@dataclass(eq=False)
class _Pool:
    name: str
    capacity: int
    owner_cap: int | None  # most one owner process may hold; None: the whole pool
    leases: dict = field(default_factory=dict)  # lease_id -> (Lease, OwnerRef)
    waiters: list = field(default_factory=list)
    peak: int = 0
    recalled: set = field(default_factory=set)  # recallable lease ids asked back, not yet released

    def leased(self) -> int:
        return sum(lease.nbytes for lease, _ in self.leases.values())

    def held_by(self, ref: OwnerRef) -> int:
        return sum(lease.nbytes for lease, r in self.leases.values() if r == ref)

    def room_for(self, ref: OwnerRef) -> int:
        """What ``ref`` could be granted now: free bytes, within its cap."""
        free = self.capacity - self.leased()
        if self.owner_cap is not None:
            free = min(free, self.owner_cap - self.held_by(ref))
        return max(0, free)


class LeasePools:
    """Named pools of bytes, leased to owner processes. Not thread-safe: one event loop only."""

    def __init__(self, capacities: Mapping[str, int], *, owner_caps: Mapping[str, int] | None = None,
                 id_prefix: str = "", label: str = "ledger"):
        caps = dict(owner_caps or {})
        unknown = set(caps) - set(capacities)
        if unknown:
            raise ValueError(f"owner caps for unknown pools {sorted(unknown)}")
        self._pools = {name: _Pool(name, int(cap), caps.get(name)) for name, cap in capacities.items()}
        self._prefix, self._label = id_prefix, label
        self._ids, self._seq = itertools.count(1), itertools.count(1)
        self.reclaimed_bytes = 0
        self.recalls_sent = 0
        self._recall_events: dict[OwnerRef, asyncio.Event] = {}  # wakes an owner's long poll

    # ---- queries ---------------------------------------------------------------------------
    def states(self) -> tuple[PoolState, ...]:
        return tuple(PoolState(p.name, p.capacity, p.leased(), p.peak, len(p.leases), len(p.waiters))
                     for p in self._pools.values())

    def capacity(self, pool: str) -> int:
        return self._pool(pool).capacity

    def outstanding(self, pool: str | None = None, owner: str | None = None) -> tuple[Lease, ...]:
        pools = self._pools.values() if pool is None else (self._pool(pool),)
        return tuple(lease for p in pools for lease, _ in p.leases.values() if owner is None or lease.owner == owner)

    def leased_by_process(self, pool: str) -> tuple[tuple[int, int], ...]:
        """(pid, bytes leased) per owner process in ``pool``: what a neighbour's device headroom leaves
        alone until the process holds it (cluster/replica/neighbours.py). One node per ledger: pids are unique."""
        by_pid: dict[int, int] = {}
        for lease, ref in self._pool(pool).leases.values():
            by_pid[ref.pid] = by_pid.get(ref.pid, 0) + lease.nbytes
        return tuple(sorted(by_pid.items()))

    def owners(self) -> set[OwnerRef]:
        return {ref for p in self._pools.values() for _, ref in p.leases.values()}

    # ---- leasing ---------------------------------------------------------------------------
    async def request(self, pool: str, nbytes: int, ref: OwnerRef, *, owner: str | None = None,
                      priority: float = 0.0, purpose: str = "", wait_s: float = 0.0,
                      recallable: bool = False) -> Lease | Refusal:
        """Grant now if it fits and nobody of higher priority waits; else wait up to ``wait_s``.

        A waiting request recalls other owners' reservations (see the module doc).
        """
        p, nbytes, owner = self._pool(pool), int(nbytes), owner or ref.owner
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        if nbytes > p.capacity:
            return self._refuse(p, nbytes, ref, f"larger than the whole pool ({p.capacity} B)")
        if p.owner_cap is not None and p.held_by(ref) + nbytes > p.owner_cap:
            return self._refuse(p, nbytes, ref, f"per-replica cap {p.owner_cap} B, {p.held_by(ref)} B already held")
        outranked = any(w.priority >= priority for w in p.waiters)  # equal priority: first come first
        if nbytes <= p.capacity - p.leased() and not outranked:
            return self._grant(p, nbytes, ref, owner, priority, purpose, recallable)
        if wait_s <= 0:
            return self._refuse(p, nbytes, ref, "outranked by a waiting request" if outranked else "full")
        return await self._wait(p, _Waiter(next(self._seq), nbytes, ref, owner, priority, purpose,
                                           asyncio.get_running_loop().create_future(), recallable), wait_s)

    async def resize(self, pool: str, lease_id: str, nbytes: int, *, wait_s: float = 0.0) -> Lease | Refusal:
        """The lease, same id, at ``nbytes``: shrinking always succeeds; growing takes the added bytes
        now if they fit (nobody of higher priority waiting), else waits for them up to ``wait_s``."""
        p, nbytes = self._pool(pool), int(nbytes)
        if lease_id not in p.leases:
            raise KeyError(f"lease {lease_id} is not outstanding in pool {pool} of {self._label}")
        lease, ref = p.leases[lease_id]
        added = nbytes - lease.nbytes
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        if added <= 0 or (added <= p.capacity - p.leased()
                          and not any(w.priority >= lease.priority for w in p.waiters)):
            return self._replace(p, lease, ref, nbytes)
        if nbytes > p.capacity:
            return self._refuse(p, added, ref, f"growing to {nbytes} B: larger than the whole pool ({p.capacity} B)")
        if p.owner_cap is not None and p.held_by(ref) + added > p.owner_cap:
            return self._refuse(p, added, ref, f"per-replica cap {p.owner_cap} B, {p.held_by(ref)} B already held")
        if wait_s <= 0:
            return self._refuse(p, added, ref, f"growing {lease_id} to {nbytes} B: full")
        waiter = _Waiter(next(self._seq), added, ref, lease.owner, lease.priority, lease.purpose,
                         asyncio.get_running_loop().create_future(), lease.recallable, grow=lease_id)
        return await self._wait(p, waiter, wait_s)

    async def _wait(self, p: _Pool, waiter: _Waiter, wait_s: float) -> Lease | Refusal:
        p.waiters.append(waiter)
        self._recall_for(p, waiter)
        await asyncio.wait({waiter.future}, timeout=wait_s)  # asyncio.wait never cancels the future
        if waiter.future.done():
            return waiter.future.result()
        p.waiters.remove(waiter)
        return self._refuse(p, waiter.nbytes, waiter.ref, f"still full after waiting {wait_s:.1f} s")

    async def recalls(self, ref: OwnerRef, timeout_s: float) -> tuple[tuple[str, str], ...]:
        """(pool, lease id) of ``ref``'s reservations the pools ask back; waits up to ``timeout_s``
        for one when there is none (the owner's long poll)."""
        event = self._recall_events.setdefault(ref, asyncio.Event())
        if not self._recalled_of(ref):
            event.clear()
            try:
                await asyncio.wait_for(event.wait(), timeout_s)
            except asyncio.TimeoutError:
                pass
        return self._recalled_of(ref)

    def release(self, pool: str, lease_id: str) -> None:
        p = self._pool(pool)
        if p.leases.pop(lease_id, None) is None:
            raise KeyError(f"lease {lease_id} is not outstanding in pool {pool} of {self._label}")
        p.recalled.discard(lease_id)
        self._serve_waiters(p)

    def readopt(self, held: tuple[tuple[str, Lease], ...], ref: OwnerRef) -> None:
        """Record leases an owner still holds from before (the bytes are really held: never refused)."""
        for pool, lease in held:
            p = self._pool(pool)
            if lease.lease_id not in p.leases:  # a recallable one stays recallable (Lease.recallable)
                p.leases[lease.lease_id] = (lease, ref)
                p.peak = max(p.peak, p.leased())
        if held:
            logger.info("%s: %s re-registered %d lease(s), %d B; pools now %s", self._label, ref.owner, len(held),
                        sum(lease.nbytes for _, lease in held),
                        ", ".join(f"{p.name}={p.leased()}/{p.capacity} B" for p in self._pools.values()))

    def reclaim(self, ref: OwnerRef, why: str) -> int:
        """Drop every lease of a dead owner; returns the bytes freed."""
        total = 0
        for p in self._pools.values():
            dead = [lid for lid, (_, r) in p.leases.items() if r == ref]
            freed = sum(p.leases.pop(lid)[0].nbytes for lid in dead)
            p.recalled.difference_update(dead)
            if dead:
                total += freed
                logger.info("%s reclaimed %d B in %d lease(s) of %s from %s: %s",
                            self._label, freed, len(dead), p.name, ref.owner, why)
                self._serve_waiters(p)
        self.reclaimed_bytes += total
        self._recall_events.pop(ref, None)
        return total

    # ---- internals -------------------------------------------------------------------------
    def _pool(self, name: str) -> _Pool:
        if name not in self._pools:
            raise KeyError(f"{self._label} has no pool {name!r}; pools: {sorted(self._pools)}")
        return self._pools[name]

    def _refuse(self, p: _Pool, nbytes: int, ref: OwnerRef, why: str) -> Refusal:
        # What this owner could get now, cap included: a hosting plan refits itself to this figure.
        available = p.room_for(ref)
        logger.info("%s refused %d B of %s to %s: %s (%d of %d B free for it)",
                    self._label, nbytes, p.name, ref.owner, why, available, p.capacity)
        return Refusal(ref.owner, nbytes, available, f"{p.name}: {why}; {available} B of {p.capacity} B free")

    def _grant(self, p: _Pool, nbytes: int, ref: OwnerRef, owner: str, priority: float, purpose: str,
               recallable: bool = False) -> Lease:
        lease = Lease(f"{p.name}-{self._prefix}{next(self._ids)}", owner, nbytes, priority, purpose, recallable)
        p.leases[lease.lease_id] = (lease, ref)
        p.peak = max(p.peak, p.leased())
        logger.info("%s granted %d B of %s to %s for %s (priority %.3g%s): %d of %d B leased",
                    self._label, nbytes, p.name, owner, purpose or "-", priority,
                    ", recallable" if recallable else "", p.leased(), p.capacity)
        return lease

    def _replace(self, p: _Pool, lease: Lease, ref: OwnerRef, nbytes: int) -> Lease:
        resized = dataclasses.replace(lease, nbytes=nbytes)
        p.leases[lease.lease_id] = (resized, ref)
        p.peak = max(p.peak, p.leased())
        logger.info("%s resized %s of %s (%s) from %d B to %d B: %d of %d B leased", self._label, lease.lease_id,
                    lease.owner, lease.purpose or "-", lease.nbytes, nbytes, p.leased(), p.capacity)
        if nbytes < lease.nbytes:
            self._serve_waiters(p)
        return resized

    def _recalled_of(self, ref: OwnerRef) -> tuple[tuple[str, str], ...]:
        return tuple((p.name, lid) for p in self._pools.values() for lid in sorted(p.recalled)
                     if p.leases[lid][1] == ref)

    def _recall_for(self, p: _Pool, waiter: _Waiter) -> None:
        """Ask other owners' reservations back, largest first, until the waiter's bytes are covered."""
        coming = sum(p.leases[lid][0].nbytes for lid in p.recalled)
        short = waiter.nbytes - (p.capacity - p.leased()) - coming
        idle = sorted(((lease, ref) for lid, (lease, ref) in p.leases.items()
                       if lease.recallable and ref != waiter.ref and lid not in p.recalled),
                      key=lambda item: -item[0].nbytes)
        for lease, ref in idle:
            if short <= 0:
                break
            p.recalled.add(lease.lease_id)
            short -= lease.nbytes
            self.recalls_sent += 1
            logger.info("%s recalls %s (%d B of %s, reserved by %s) for %s waiting on %d B", self._label,
                        lease.lease_id, lease.nbytes, p.name, lease.owner, waiter.owner, waiter.nbytes)
            if ref in self._recall_events:
                self._recall_events[ref].set()

    def _serve_waiters(self, p: _Pool) -> None:
        """Grant waiters in order (highest priority, then first come) while the head of the queue fits.

        Strict order: letting a small later waiter pass a big earlier one would starve the big one.
        """
        for w in sorted(p.waiters, key=lambda w: (-w.priority, w.seq)):
            if w.grow is not None and w.grow not in p.leases:  # released while it waited to grow
                p.waiters.remove(w)
                w.future.set_result(self._refuse(p, w.nbytes, w.ref, f"lease {w.grow} released while growing"))
                continue
            if w.nbytes > p.capacity - p.leased():
                break
            p.waiters.remove(w)
            if w.grow is not None:
                lease, ref = p.leases[w.grow]
                w.future.set_result(self._replace(p, lease, ref, lease.nbytes + w.nbytes))
            else:
                w.future.set_result(self._grant(p, w.nbytes, w.ref, w.owner, w.priority, w.purpose, w.recallable))
