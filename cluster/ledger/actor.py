"""One memory ledger actor per Ray node: host RAM and each GPU's memory, leased to every replica.

Why one per node: replicas that each measure "available RAM" on their own all spend the same free
bytes and the node over-commits pinned memory until the OOM killer (or Ray's memory monitor at
95 %) takes one down. The ledger is an async actor: every grant runs on its one event loop with
no await between "does it fit" and "record it", so replicas starting at once cannot over-commit.

Pools: ``host`` (spendable = node available - reserve - Ray's object store) and ``gpu:<i>`` per
GPU (its memory less the fleet profile's reserve). A request either fits now, waits (bounded,
served by priority = bytes x uses per request), or is refused with the numbers.

Dead owners are found by observation (cluster/ledger/liveness.py) every ``liveness_interval_s`` and
their leases reclaimed. The actor restarts forever (max_restarts=-1); a restarted ledger has a
new epoch, holds new grants for ``recovery_s`` while replicas re-register what they hold (their
clients heartbeat the epoch), so no accounting is lost. The accounting itself is
cluster/ledger/pools.py (pure asyncio); the replica side is cluster/replica/ledger_client.py.
"""
from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from cluster.fleet import profile_for_gpu
from cluster.ledger.liveness import OwnerRef, actor_info, find_dead
from cluster.ledger.pools import LeasePools, PoolState
from cluster.node import GB, probe_node
from offload_core.host.budget import Lease, Refusal
from offload_core.shared_store.files import sweep_orphans
from offload_core.shared_store.ledger_record import SharedStores, StoreState

logger = logging.getLogger(__name__)

NAMESPACE = "offload-serve"
# Answers kept for retried requests: a retry comes within one client backoff (<= 60 s); 4096
# answers cover ~70 grants/s for a minute, far above a node's replica start rate.
ANSWERS_KEPT = 4096
HOST_POOL = "host"


def gpu_pool(index: int) -> str:
    return f"gpu:{index}"


def ledger_name(node_id: str) -> str:
    return f"offload-ledger-{node_id}"


@dataclass(frozen=True)
class LedgerConfig:
    # Kept out of the host pool for the OS, Python heaps and the page cache of mapped weights;
    # None: offload_core.host.ram's default, max(5 % of total, 2 GiB).
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
        if self.recovery_s < 2 * self.heartbeat_s:
            raise ValueError(f"recovery_s={self.recovery_s} must cover two client heartbeats ({self.heartbeat_s} s "
                             "each), or a restarted ledger grants bytes an idle replica still holds but has not "
                             "re-registered yet")
        if self.owner_cap_fraction is not None and not 0.0 < self.owner_cap_fraction <= 1.0:
            raise ValueError(f"owner_cap_fraction must be in (0, 1], got {self.owner_cap_fraction}")
        if min(self.liveness_interval_s, self.heartbeat_s) <= 0:
            raise ValueError("liveness_interval_s and heartbeat_s must be > 0")


@dataclass(frozen=True)
class StaleEpoch:
    """The ledger restarted since the client last saw it: re-register, then retry."""

    epoch: str


@dataclass(frozen=True)
class Pulse:
    """The heartbeat's answer: the epoch, and per pool asked about the bytes each process leases."""

    epoch: str
    leased_by_process: tuple[tuple[str, tuple[tuple[int, int], ...]], ...]  # (pool, ((pid, bytes), ...))


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


def _log_decisions_in_this_worker() -> None:
    """Ray workers have no log handler and a WARNING root: the ledger's INFO decision lines would
    vanish. Send the cluster loggers to stderr (the worker's .err file, `ray logs`)."""
    cluster_logger = logging.getLogger("cluster")
    cluster_logger.setLevel(logging.INFO)
    if not cluster_logger.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        cluster_logger.addHandler(handler)


class NodeLedger:
    """The actor body: node facts -> pools, epochs, recovery and liveness. Create via :func:`node_ledger`."""

    def __init__(self, node_id: str, config: LedgerConfig):
        self._node_id, self._config = node_id, config
        _log_decisions_in_this_worker()
        facts = probe_node(node_id, reserve=config.reserve_bytes)
        profile = profile_for_gpu(facts.gpus[0] if facts.gpus else None)
        spendable = facts.ram.spendable
        capacities = {HOST_POOL: spendable}
        capacities.update({gpu_pool(g.index): profile.device_pool_bytes(g) for g in facts.gpus})
        fraction = profile.host_pin_cap_fraction if config.owner_cap_fraction is None else config.owner_cap_fraction
        self._owner_cap = int(spendable * fraction)
        self._epoch = uuid.uuid4().hex[:12]
        self._pools = LeasePools(capacities, owner_caps={HOST_POOL: self._owner_cap},
                                 id_prefix=f"{self._epoch}-", label=f"ledger {node_id[:8]}")
        self._restarted = actor_info(ray.get_runtime_context().get_actor_id()).get("NumRestarts", 0) > 0
        self._recovering_until = time.monotonic() + config.recovery_s if self._restarted else 0.0
        self._stores = SharedStores(self._pools, HOST_POOL, OwnerRef.of_this_process(f"ledger-{node_id[:8]}"),
                                    f"ledger {node_id[:8]}")
        # Stores a crashed process left in this node's shared memory: nobody holds them any more.
        sweep_orphans()
        self._reclaimer: asyncio.Task | None = None
        self._answers: OrderedDict[str, asyncio.Future] = OrderedDict()  # request_id -> answer
        logger.info("ledger %s epoch %s%s: host pool %.2f GB (%s%s); per-replica cap %.2f GB (%.0f %%); "
                    "GPU pools: %s", node_id, self._epoch,
                    " (restarted: grants wait %.1f s for re-registration)" % config.recovery_s if self._restarted else "",
                    spendable / GB, "injected RAM; " if facts.ram_injected else "", facts.ram.log_line(),
                    self._owner_cap / GB, 100 * fraction,
                    ", ".join(f"{k}={v / GB:.1f} GB" for k, v in capacities.items() if k != HOST_POOL) or "none")

    # ---- queries ---------------------------------------------------------------------------
    async def epoch(self) -> str:
        self._ensure_reclaimer()
        return self._epoch

    async def state(self) -> LedgerState:
        self._ensure_reclaimer()
        return LedgerState(self._node_id, self._epoch, self._restarted, self._pools.states(), self._owner_cap,
                           self._pools.reclaimed_bytes)

    async def pulse(self, pools: tuple[str, ...]) -> Pulse:
        """The epoch (as :meth:`epoch`) and each of ``pools``' leases per process: replicas learn their
        neighbours' leases on the heartbeat they make anyway, never on a call's path."""
        self._ensure_reclaimer()
        return Pulse(self._epoch, tuple((pool, self._pools.leased_by_process(pool)) for pool in pools))

    async def capacity(self, pool: str) -> int:
        return self._pools.capacity(pool)

    async def outstanding(self, pool: str | None = None, owner: str | None = None) -> tuple[Lease, ...]:
        return self._pools.outstanding(pool, owner)

    # ---- leasing ---------------------------------------------------------------------------
    async def request(self, pool: str, nbytes: int, ref: OwnerRef, priority: float = 0.0, purpose: str = "",
                      client_epoch: str | None = None, wait_s: float = 0.0,
                      owner: str | None = None, request_id: str | None = None,
                      recallable: bool = False) -> Lease | Refusal | StaleEpoch:
        """Grant ``nbytes`` of ``pool`` to the process ``ref`` (leases named ``owner``, default ref.owner).

        Fits now -> Lease. Else waits up to ``wait_s`` (higher ``priority`` served first) -> Lease
        or Refusal. A client that saw an older epoch gets StaleEpoch and must re-register first.
        A repeated ``request_id`` (a client's retry) gets the first call's answer. A ``recallable``
        lease is a reservation the ledger may ask back (cluster/ledger/pools.py).
        """
        self._ensure_reclaimer()
        if client_epoch is not None and client_epoch != self._epoch:
            return StaleEpoch(self._epoch)
        return await self._once(request_id, lambda: self._answer(
            self._pools.request(pool, nbytes, ref, owner=owner, priority=priority, purpose=purpose,
                                wait_s=wait_s, recallable=recallable)))

    async def resize(self, pool: str, lease_id: str, nbytes: int, client_epoch: str | None = None,
                     wait_s: float = 0.0, request_id: str | None = None) -> Lease | Refusal | StaleEpoch:
        """The lease at ``nbytes`` (same id); growing waits up to ``wait_s`` for the added bytes."""
        self._ensure_reclaimer()
        if client_epoch is not None and client_epoch != self._epoch:
            return StaleEpoch(self._epoch)
        return await self._once(request_id, lambda: self._answer(
            self._pools.resize(pool, lease_id, nbytes, wait_s=wait_s)))

    async def recalls(self, ref: OwnerRef, timeout_s: float) -> tuple[tuple[str, str], ...]:
        """(pool, lease id) of the reservations ``ref`` is asked to give back; a long poll."""
        self._ensure_reclaimer()
        return await self._pools.recalls(ref, timeout_s)

    async def _once(self, request_id: str | None, make) -> Lease | Refusal:
        """One answer per ``request_id``: a client's retry gets the first attempt's answer."""
        if request_id is not None and request_id in self._answers:
            return await asyncio.shield(self._answers[request_id])
        answer = asyncio.ensure_future(make())
        if request_id is not None:
            self._answers[request_id] = answer
            while len(self._answers) > ANSWERS_KEPT:
                self._answers.popitem(last=False)
        return await asyncio.shield(answer)

    async def _answer(self, pending) -> Lease | Refusal:
        await self._recovered()
        return await pending

    async def release(self, pool: str, lease_id: str, client_epoch: str | None = None,
                      missing_ok: bool = False) -> StaleEpoch | None:
        """Give a lease back; ``missing_ok`` for a client's retry, whose first attempt may have run."""
        if client_epoch is not None and client_epoch != self._epoch:
            return StaleEpoch(self._epoch)
        if missing_ok and lease_id not in {lease.lease_id for lease in self._pools.outstanding(pool)}:
            return None
        self._pools.release(pool, lease_id)
        return None

    async def readopt(self, held: tuple[tuple[str, Lease], ...], ref: OwnerRef) -> str:
        """Record leases a replica still holds from an earlier epoch (after a ledger restart)."""
        self._pools.readopt(held, ref)
        return self._epoch

    # ---- shared weight stores (offload_core/shared_store/ledger_record.py) ----
    async def store_attach(self, digest: str, component: str, path: str, nbytes: int, budget_bytes: int | None,
                           ref: OwnerRef, client_epoch: str | None = None):
        self._ensure_reclaimer()
        if client_epoch is not None and client_epoch != self._epoch:
            return StaleEpoch(self._epoch)
        await self._recovered()
        return await self._stores.attach(digest, component, path, nbytes, ref, budget_bytes)

    async def store_ready(self, digest: str, ref: OwnerRef, client_epoch: str | None = None):
        if client_epoch is not None and client_epoch != self._epoch:
            return StaleEpoch(self._epoch)
        self._stores.ready(digest, ref)

    async def store_detach(self, digest: str, ref: OwnerRef, client_epoch: str | None = None):
        if client_epoch is not None and client_epoch != self._epoch:
            return StaleEpoch(self._epoch)
        self._stores.detach(digest, ref)

    async def store_attachment(self, digest: str, ref: OwnerRef, client_epoch: str | None = None):
        return self._stores.attachment(digest)

    async def store_readopt(self, digest: str, component: str, path: str, nbytes: int, budget_bytes: int | None,
                            ref: OwnerRef, client_epoch: str | None = None):
        self._stores.readopt(digest, component, path, nbytes, ref, budget_bytes)

    async def stores(self) -> tuple[StoreState, ...]:
        return self._stores.states()

    # ---- recovery and liveness ---------------------------------------------------------------
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
            owners = set(self._pools.owners()) | self._stores.owners()
            if owners:
                for ref in await asyncio.to_thread(find_dead, owners, self._node_id):
                    why = f"owner process {ref.pid} (actor {ref.actor_id}) is dead"
                    self._stores.reclaim(ref, why)
                    self._pools.reclaim(ref, why)


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
