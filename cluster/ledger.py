"""One memory ledger actor per Ray node: host RAM and each GPU's memory, leased to every replica.

Why one per node: replicas that each measure "available RAM" on their own all spend the same free
bytes and the node over-commits pinned memory until the OOM killer (or Ray's memory monitor at
95 %) takes one down. The ledger is an async actor: every grant runs on its one event loop with
no await between "does it fit" and "record it", so replicas starting at once cannot over-commit.

Pools: ``host`` (spendable = node available - reserve - Ray's object store) and ``gpu:<i>`` per
GPU (its memory less the fleet profile's reserve). A request either fits now, waits (bounded,
served by priority = bytes x uses per request), or is refused with the numbers.

Dead owners are found by observation (cluster/liveness.py) every ``liveness_interval_s`` and
their leases reclaimed. The actor restarts forever (max_restarts=-1); a restarted ledger has a
new epoch, holds new grants for ``recovery_s`` while replicas re-register what they hold (their
clients heartbeat the epoch), so no accounting is lost. The client side is cluster/ledger_client.py.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import time
import uuid
from dataclasses import dataclass, field

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from cluster.fleet import profile_for_gpu
from cluster.liveness import OwnerRef, actor_info, find_dead
from cluster.node import GB, probe_node
from offload_core.budget import Lease, Refusal

logger = logging.getLogger(__name__)

NAMESPACE = "offload-serve"
HOST_POOL = "host"


def gpu_pool(index: int) -> str:
    return f"gpu:{index}"


def ledger_name(node_id: str) -> str:
    return f"offload-ledger-{node_id}"


@dataclass(frozen=True)
class LedgerConfig:
    # Kept out of the host pool for the OS, Python heaps and the page cache of mapped weights;
    # None: offload_core.host_memory's default, max(5 % of total, 2 GiB).
    reserve_bytes: int | None = None
    # Most of the host pool one replica may hold; None takes the node's fleet profile's
    # host_pin_cap_fraction (0.5 on 12-24 GB nodes: two replicas can always pin something).
    owner_cap_fraction: float | None = None
    # Reclaim bound: a dead replica's leases return within ~this + one GCS lookup (~10 ms).
    liveness_interval_s: float = 2.0
    # After a restart, grants wait this long for replicas to re-register; > 2 client heartbeats.
    recovery_s: float = 5.0
    heartbeat_s: float = 2.0  # how often a client checks the ledger's epoch

    def __post_init__(self):
        assert self.recovery_s >= 2 * self.heartbeat_s, (
            "recovery_s must cover two client heartbeats, or a restarted ledger grants bytes that "
            "an idle replica still holds but has not re-registered yet")


@dataclass(frozen=True)
class StaleEpoch:
    """The ledger restarted since the client last saw it: re-register, then retry."""

    epoch: str


@dataclass(frozen=True)
class PoolState:
    name: str
    capacity: int
    leased: int
    peak_leased: int  # the most ever leased at once in this epoch
    leases: int
    waiters: int


@dataclass(frozen=True)
class LedgerState:
    node_id: str
    epoch: str
    restarted: bool
    pools: tuple[PoolState, ...]
    owner_cap_bytes: int
    reclaimed_bytes: int  # given back by liveness checks, this epoch

    def pool(self, name: str) -> PoolState:
        return next(p for p in self.pools if p.name == name)


@dataclass(eq=False)
class _Waiter:
    seq: int
    nbytes: int
    ref: OwnerRef
    owner: str
    priority: float
    purpose: str
    future: asyncio.Future


@dataclass(eq=False)
class _Pool:
    name: str
    capacity: int
    leases: dict = field(default_factory=dict)  # lease_id -> (Lease, OwnerRef)
    waiters: list = field(default_factory=list)
    peak: int = 0

    def leased(self) -> int:
        return sum(lease.nbytes for lease, _ in self.leases.values())

    def held_by(self, ref: OwnerRef) -> int:
        return sum(lease.nbytes for lease, r in self.leases.values() if r == ref)


class NodeLedger:
    """The actor body. Create it through :func:`node_ledger`, never directly."""

    def __init__(self, node_id: str, config: LedgerConfig):
        self._node_id, self._config = node_id, config
        if not logging.getLogger("cluster").isEnabledFor(logging.INFO):
            # Ray workers log WARNING and up by default; the ledger's grants are decisions to keep.
            logging.getLogger("cluster").setLevel(logging.INFO)
        facts = probe_node(node_id, reserve=config.reserve_bytes)
        profile = profile_for_gpu(facts.gpus[0] if facts.gpus else None)
        spendable = facts.ram.spendable
        self._pools = {HOST_POOL: _Pool(HOST_POOL, spendable)}
        for gpu in facts.gpus:
            self._pools[gpu_pool(gpu.index)] = _Pool(gpu_pool(gpu.index), profile.device_pool_bytes(gpu))
        fraction = profile.host_pin_cap_fraction if config.owner_cap_fraction is None else config.owner_cap_fraction
        self._owner_cap = int(spendable * fraction)
        self._epoch = uuid.uuid4().hex[:12]
        self._ids, self._seq = itertools.count(1), itertools.count(1)
        self._reclaimed = 0
        self._restarted = actor_info(ray.get_runtime_context().get_actor_id()).get("NumRestarts", 0) > 0
        self._recovering_until = time.monotonic() + config.recovery_s if self._restarted else 0.0
        self._reclaimer: asyncio.Task | None = None
        logger.info("ledger %s epoch %s%s: host pool %.2f GB (%s%s); per-replica cap %.2f GB (%.0f %%); "
                    "GPU pools: %s", node_id, self._epoch,
                    " (restarted: grants wait %.1f s for re-registration)" % config.recovery_s if self._restarted else "",
                    spendable / GB, "injected RAM; " if facts.ram_injected else "", facts.ram.log_line(),
                    self._owner_cap / GB, 100 * fraction,
                    ", ".join(f"{p.name}={p.capacity / GB:.1f} GB" for p in self._pools.values()
                              if p.name != HOST_POOL) or "none")

    # ---- queries ---------------------------------------------------------------------------
    async def epoch(self) -> str:
        self._ensure_reclaimer()
        return self._epoch

    async def state(self) -> LedgerState:
        self._ensure_reclaimer()
        pools = tuple(PoolState(p.name, p.capacity, p.leased(), p.peak, len(p.leases), len(p.waiters))
                      for p in self._pools.values())
        return LedgerState(self._node_id, self._epoch, self._restarted, pools, self._owner_cap, self._reclaimed)

    async def capacity(self, pool: str) -> int:
        return self._pool(pool).capacity

    async def outstanding(self, pool: str | None = None, owner: str | None = None) -> tuple[Lease, ...]:
        pools = self._pools.values() if pool is None else (self._pool(pool),)
        return tuple(lease for p in pools for lease, _ in p.leases.values() if owner is None or lease.owner == owner)

    # ---- leasing ---------------------------------------------------------------------------
    async def request(self, pool: str, nbytes: int, ref: OwnerRef, priority: float = 0.0, purpose: str = "",
                      client_epoch: str | None = None, wait_s: float = 0.0,
                      owner: str | None = None) -> Lease | Refusal | StaleEpoch:
        """Grant ``nbytes`` of ``pool`` to the process ``ref`` (leases named ``owner``, default ref.owner).

        Fits now -> Lease. Else waits up to ``wait_s`` (higher ``priority`` served first) -> Lease
        or Refusal. A client that saw an older epoch gets StaleEpoch and must re-register first.
        """
        self._ensure_reclaimer()
        owner = owner or ref.owner
        if client_epoch is not None and client_epoch != self._epoch:
            return StaleEpoch(self._epoch)
        p = self._pool(pool)
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        await self._recovered()
        if (refusal := self._never_fits(p, int(nbytes), ref)) is not None:
            return refusal
        outranked = any(w.priority > priority for w in p.waiters)
        if nbytes <= p.capacity - p.leased() and not outranked:
            return self._grant(p, int(nbytes), ref, owner, priority, purpose)
        if wait_s <= 0:
            return self._refuse(p, int(nbytes), ref, "outranked by a waiting request" if outranked else "full")
        waiter = _Waiter(next(self._seq), int(nbytes), ref, owner, priority, purpose,
                         asyncio.get_running_loop().create_future())
        p.waiters.append(waiter)
        await asyncio.wait({waiter.future}, timeout=wait_s)
        if waiter.future.done():
            return waiter.future.result()
        p.waiters.remove(waiter)
        return self._refuse(p, int(nbytes), ref, f"still full after waiting {wait_s:.1f} s")

    async def release(self, pool: str, lease_id: str, client_epoch: str | None = None) -> StaleEpoch | None:
        if client_epoch is not None and client_epoch != self._epoch:
            return StaleEpoch(self._epoch)
        p = self._pool(pool)
        if p.leases.pop(lease_id, None) is None:
            raise KeyError(f"lease {lease_id} is not outstanding in pool {pool} of ledger {self._node_id}")
        self._serve_waiters(p)
        return None

    async def readopt(self, held: tuple[tuple[str, Lease], ...], ref: OwnerRef) -> str:
        """Record leases a replica still holds from an earlier epoch (after a ledger restart)."""
        for pool, lease in held:
            p = self._pool(pool)
            if lease.lease_id not in p.leases:
                p.leases[lease.lease_id] = (lease, ref)
                p.peak = max(p.peak, p.leased())
        if held:
            logger.info("ledger %s: %s re-registered %d lease(s), %d B; pools now %s", self._node_id, ref.owner,
                        len(held), sum(l.nbytes for _, l in held),
                        ", ".join(f"{p.name}={p.leased()}/{p.capacity} B" for p in self._pools.values()))
        return self._epoch

    # ---- internals -------------------------------------------------------------------------
    def _pool(self, name: str) -> _Pool:
        if name not in self._pools:
            raise KeyError(f"ledger {self._node_id} has no pool {name!r}; pools: {sorted(self._pools)}")
        return self._pools[name]

    def _never_fits(self, p: _Pool, nbytes: int, ref: OwnerRef) -> Refusal | None:
        if nbytes > p.capacity:
            return self._refuse(p, nbytes, ref, f"larger than the whole pool ({p.capacity} B)")
        if p.name == HOST_POOL and p.held_by(ref) + nbytes > self._owner_cap:
            return self._refuse(p, nbytes, ref, f"per-replica cap {self._owner_cap} B, "
                                                f"{p.held_by(ref)} B already held")
        return None

    def _refuse(self, p: _Pool, nbytes: int, ref: OwnerRef, why: str) -> Refusal:
        # What this owner could get now: a plan refits to this figure, so it includes the cap.
        available = p.capacity - p.leased()
        if p.name == HOST_POOL:
            available = max(0, min(available, self._owner_cap - p.held_by(ref)))
        logger.info("ledger %s refused %d B of %s to %s: %s (%d of %d B free)",
                    self._node_id, nbytes, p.name, ref.owner, why, available, p.capacity)
        return Refusal(ref.owner, nbytes, available, f"{p.name}: {why}; {available} B of {p.capacity} B free")

    def _grant(self, p: _Pool, nbytes: int, ref: OwnerRef, owner: str, priority: float, purpose: str) -> Lease:
        lease = Lease(f"{p.name}-{self._epoch}-{next(self._ids)}", owner, nbytes, priority, purpose)
        p.leases[lease.lease_id] = (lease, ref)
        p.peak = max(p.peak, p.leased())
        logger.info("ledger %s granted %d B of %s to %s for %s (priority %.3g): %d of %d B leased",
                    self._node_id, nbytes, p.name, owner, purpose or "-", priority, p.leased(), p.capacity)
        return lease

    def _serve_waiters(self, p: _Pool) -> None:
        """Grant waiting requests that now fit, highest priority first (then first come)."""
        for w in sorted(p.waiters, key=lambda w: (-w.priority, w.seq)):
            if w.nbytes <= p.capacity - p.leased() and not w.future.done():
                p.waiters.remove(w)
                w.future.set_result(self._grant(p, w.nbytes, w.ref, w.owner, w.priority, w.purpose))

    async def _recovered(self) -> None:
        delay = self._recovering_until - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)

    def _ensure_reclaimer(self) -> None:
        # Started on the first call: an async actor's __init__ runs before its event loop does.
        if self._reclaimer is None:
            self._reclaimer = asyncio.get_running_loop().create_task(self._reclaim_forever())

    async def _reclaim_forever(self) -> None:
        while True:
            await asyncio.sleep(self._config.liveness_interval_s)
            refs = {ref for p in self._pools.values() for _, ref in p.leases.values()}
            if refs:
                for ref in await asyncio.to_thread(find_dead, refs, self._node_id):
                    self._reclaim(ref)

    def _reclaim(self, ref: OwnerRef) -> None:
        for p in self._pools.values():
            dead = [lid for lid, (_, r) in p.leases.items() if r == ref]
            freed = sum(p.leases.pop(lid)[0].nbytes for lid in dead)
            if dead:
                self._reclaimed += freed
                logger.info("ledger %s reclaimed %d B in %d lease(s) of %s from %s: owner process %d is dead",
                            self._node_id, freed, len(dead), p.name, ref.owner, ref.pid)
                self._serve_waiters(p)


NodeLedgerActor = ray.remote(NodeLedger)


def node_ledger(node_id: str | None = None, config: LedgerConfig = LedgerConfig()):
    """The ledger actor of ``node_id`` (default: the caller's node), created on first use.

    Named per node in a fixed namespace, detached, pinned to its node with hard affinity,
    num_cpus=0 (it must never wait for a CPU the replicas hold). The first creator's config wins.
    """
    node_id = node_id or ray.get_runtime_context().get_node_id()
    return NodeLedgerActor.options(
        name=ledger_name(node_id), namespace=NAMESPACE, get_if_exists=True, lifetime="detached",
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
        num_cpus=0, max_restarts=-1, max_task_retries=0,
    ).remote(node_id, config)
