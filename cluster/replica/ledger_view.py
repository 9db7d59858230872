"""The replica's view of its node's one ledger: its host budget, its GPU's pool, its neighbours' leases.

    memory = ReplicaMemory.open("denoise#abc", device)      # on replica start
    plan with memory.profile, pin through memory.host_budget
    leases = memory.device_leases(to_driver=torch.cuda.empty_cache)
    leases.hold_standing(kept_bytes, timeout_s)            # what the plan keeps on the device
    with leases.call(added_bytes, timeout_s):              # around each stage call
        run the stage
    memory.close()                                           # on replica shutdown

Ray's fractional ``num_gpus`` is logical only: three stages sharing a 12 GB card OOM when two
requests put two of them at work at once. Each stage call therefore leases what it adds on its GPU
first (:mod:`cluster.replica.device_leases`: kept between calls as a recallable reservation); a
replica that cannot get it waits (bounded) and the service answers :class:`DeviceBusy` (raised by
the stage worker) with 503 and Retry-After, never an OOM.

With Ray initialised the budgets are pools of the node ledger actor (cluster/ledger/actor.py). Without
Ray they are process-local ledgers, said in a log line: one process is then the whole "node".
"""
from __future__ import annotations

import logging
import math
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from cluster.fleet import FleetProfile, profile_for_gpu
from cluster.ledger.actor import HOST_POOL, LedgerConfig, gpu_pool
from cluster.node import GB, GpuInfo, NodeInfo, cuda_visible_ids, probe_node, visible_gpu_indices
from offload_core.host.budget import InProcessLedger, Lease, MemoryBudget, Refusal
from offload_core.shared_store.files import sweep_orphans
from offload_core.shared_store.registry import InProcessStoreRegistry, StoreRegistry

if TYPE_CHECKING:  # duck-typed: replicas pass torch.device, the ledger side never imports torch
    import torch

logger = logging.getLogger(__name__)


class DeviceBusy(RuntimeError):
    """The GPU stayed too full for this stage's working set for the whole bounded wait (-> 503)."""

    def __init__(self, owner: str, pool: str, nbytes: int, refusal: Refusal, waited_s: float):
        self.owner, self.pool, self.nbytes, self.waited_s = owner, pool, nbytes, waited_s
        self.refusal, self.available = refusal, refusal.available
        # Another stage's call holds the bytes; one more wait of the same length is a fair hint.
        self.retry_after_s = max(1, math.ceil(waited_s))
        super().__init__(f"{owner}: {nbytes} B of {pool} not free after {waited_s:.1f} s "
                         f"({refusal.reason})")

    def __reduce__(self):  # crosses Ray process boundaries intact (the default would lose the args)
        return (DeviceBusy, (self.owner, self.pool, self.nbytes, self.refusal, self.waited_s))


class LocalBudget(MemoryBudget):
    """An in-process ledger that can also wait for bytes and recall reservations (the no-Ray fallback)."""

    def __init__(self, capacity_bytes: int, name: str):
        self._ledger, self._name = InProcessLedger(capacity_bytes, name), name
        self._freed = threading.Condition()
        self._recallable: dict[str, str] = {}  # lease id -> owner, reservations the budget may ask back
        self._watchers: dict[str, Callable[[str], None]] = {}  # owner -> its recall callback
        self._recalled: set[str] = set()
        self.peak_leased = 0  # the most ever leased at once

    def request(self, nbytes: int, owner: str, priority: float = 0.0, purpose: str = "") -> Lease | Refusal:
        with self._freed:
            got = self._ledger.request(nbytes, owner, priority, purpose)
            self.peak_leased = max(self.peak_leased, self._ledger.leased())
            return got

    def acquire(self, nbytes: int, owner: str, priority: float = 0.0, purpose: str = "",
                wait_s: float = 0.0, recallable: bool = False) -> Lease | Refusal:
        deadline = time.monotonic() + wait_s
        with self._freed:
            while not (got := self._ledger.request(nbytes, owner, priority, purpose)):
                left = deadline - time.monotonic()
                if left <= 0 or nbytes > self._ledger.capacity():
                    return got
                self._recall(nbytes - got.available, owner)
                self._freed.wait(left)
            if recallable:
                self._recallable[got.lease_id] = owner
            self.peak_leased = max(self.peak_leased, self._ledger.leased())
            return got

    def resize(self, lease: Lease, nbytes: int, wait_s: float = 0.0) -> Lease | Refusal:
        """The lease at ``nbytes`` (a new id: the in-process ledger has no resize of its own)."""
        deadline = time.monotonic() + wait_s
        with self._freed:
            while True:
                self._ledger.release(lease)
                got = self._ledger.request(nbytes, lease.owner, lease.priority, lease.purpose)
                if got:
                    if self._recallable.pop(lease.lease_id, None) is not None:
                        self._recallable[got.lease_id] = lease.owner
                    self.peak_leased = max(self.peak_leased, self._ledger.leased())
                    self._freed.notify_all()
                    return got
                lease = self._ledger.request(lease.nbytes, lease.owner, lease.priority, lease.purpose)
                assert lease, "the bytes just released under the lock must be granted back"
                left = deadline - time.monotonic()
                if left <= 0 or nbytes > self._ledger.capacity():
                    return got
                self._recall(nbytes - lease.nbytes - got.available, lease.owner)
                self._freed.wait(left)

    def watch_recalls(self, owner: str, on_recall: Callable[[str], None]) -> None:
        with self._freed:
            self._watchers[owner] = on_recall

    def _recall(self, short: int, asker: str) -> None:
        """Ask other owners' reservations back, largest first, until ``short`` bytes are coming. Lock held."""
        held = {lease.lease_id: lease for lease in self._ledger.outstanding()}
        short -= sum(held[lid].nbytes for lid in self._recalled if lid in held)
        for lid in sorted(set(self._recallable) - self._recalled, key=lambda lid: -held[lid].nbytes):
            owner = self._recallable[lid]
            if short <= 0:
                break
            if owner == asker or owner not in self._watchers:
                continue
            self._recalled.add(lid)
            short -= held[lid].nbytes
            logger.info("%s recalls %s (%d B reserved by %s) for %s", self._name, lid, held[lid].nbytes,
                        owner, asker)
            # The holder gives it back once its own call is done: never on this (waiting) thread.
            threading.Thread(target=self._watchers[owner], args=(lid,), name=f"recall-{lid}", daemon=True).start()

    def release(self, lease: Lease) -> None:
        with self._freed:
            self._ledger.release(lease)
            self._recallable.pop(lease.lease_id, None)
            self._recalled.discard(lease.lease_id)
            self._freed.notify_all()

    def outstanding(self, owner: str | None = None) -> tuple[Lease, ...]:
        return self._ledger.outstanding(owner)

    def release_owner(self, owner: str) -> int:
        with self._freed:  # at once: a reservation given back on another thread is not released twice
            taken = self._ledger.take_owner(owner)
            for lease in taken:
                self._recallable.pop(lease.lease_id, None)
                self._recalled.discard(lease.lease_id)
            self._freed.notify_all()
            return sum(lease.nbytes for lease in taken)

    def capacity(self) -> int:
        return self._ledger.capacity()


_LOCAL: dict[str, LocalBudget] = {}  # pool -> the process's budget, shared by its replicas
_LOCAL_LOCK = threading.Lock()
_LOCAL_STORES: dict[int, InProcessStoreRegistry] = {}  # id(host budget) -> its store registry


def _local_stores(host: MemoryBudget) -> InProcessStoreRegistry:
    with _LOCAL_LOCK:
        if id(host) not in _LOCAL_STORES:
            # Without Ray no ledger starts to clean what a crashed process left: the first registry does.
            sweep_orphans()
            _LOCAL_STORES[id(host)] = InProcessStoreRegistry(host)
        return _LOCAL_STORES[id(host)]


def _local_pool(pool: str, capacity: int) -> LocalBudget:
    with _LOCAL_LOCK:
        if pool not in _LOCAL:
            _LOCAL[pool] = LocalBudget(capacity, pool)
        return _LOCAL[pool]


@dataclass(frozen=True)
class DeviceRef:
    """The device a replica computes on, read like torch.device without importing torch here."""

    type: str  # "cuda" or "cpu"
    index: int | None

    def __str__(self) -> str:
        return self.type if self.index is None else f"{self.type}:{self.index}"


def as_device(device: "torch.device | str") -> DeviceRef:
    """'cuda:1' / torch.device('cuda', 1) -> DeviceRef('cuda', 1). Unknown kinds are an error."""
    if isinstance(device, str):
        kind, _, index = device.partition(":")
        if index and not index.isdigit():
            raise ValueError(f"device {device!r}: index must be a number")
        device = DeviceRef(kind, int(index) if index else None)
    if device.type not in ("cuda", "cpu"):
        raise ValueError(f"device {device}: only cuda and cpu devices lease from the node ledger")
    return DeviceRef(device.type, device.index)


def _pick_gpu(device: DeviceRef, assigned: list[int], gpus: tuple[GpuInfo, ...], owner: str) -> GpuInfo | None:
    """The GPU whose pool this replica's device working sets lease, if any."""
    if device.type == "cuda":
        local = device.index if device.index is not None else 0
        physical = assigned[local] if local < len(assigned) else local
    elif assigned:
        # A CPU-computing replica that Ray gave a GPU (CPU-only test nodes with fake GPUs): the
        # CPU stands in for that GPU, so its working sets are accounted against it.
        physical = assigned[0]
        logger.info("%s: device cpu stands in for its assigned GPU %d", owner, physical)
    else:
        return None
    for gpu in gpus:
        if gpu.index == physical:
            return gpu
    raise LookupError(f"{owner}: device {device} maps to GPU {physical}, but the node has {len(gpus)} GPU(s)")


def assigned_gpu_fraction() -> float | None:
    """The GPUs Ray assigned to this replica (0.2 for ``num_gpus: 0.2``); None outside a Ray worker."""
    import ray

    if not ray.is_initialized():
        return None
    return float(ray.get_runtime_context().get_assigned_resources().get("GPU", 0.0)) or None


class ReplicaMemory:
    """The host and device budgets of one replica, its share of the GPU, and its device leases."""

    def __init__(self, owner: str, device: DeviceRef, node: NodeInfo, profile: FleetProfile,
                 host_budget: MemoryBudget, device_budget: MemoryBudget, device_pool: str, client=None,
                 gpu: GpuInfo | None = None, gpu_fraction: float | None = None):
        self.owner, self.device, self.node, self.profile = owner, device, node, profile
        self.host_budget, self.device_budget, self.device_pool = host_budget, device_budget, device_pool
        self.gpu = gpu
        self.gpu_fraction = gpu_fraction  # Ray's num_gpus for this replica (None: the whole GPU, or none)
        self._client = client
        self._stores: StoreRegistry | None = None
        self._neighbours = None  # cluster.replica.neighbours.NeighbourLeases, once asked for
        self._closed = False
        pool = device_budget.capacity()
        # Ray's num_gpus is logical; the share makes it the planner's capacity and the process's cap.
        self.share_bytes = pool if gpu is None or gpu_fraction is None else min(pool, int(gpu_fraction * pool))
        if gpu is not None:
            logger.info("%s: share of %s is %.2f GB of its %.2f GB pool (%s)", owner, device_pool,
                        self.share_bytes / GB, pool / GB,
                        f"num_gpus {gpu_fraction:g}" if gpu_fraction is not None else "the whole GPU")

    def store_registry(self) -> StoreRegistry:
        """Node weight stores' bookkeeping: the node ledger's with Ray, else this process's own."""
        if self._stores is None:
            if self._client is not None:
                from cluster.ledger.shared_stores import LedgerStoreRegistry

                self._stores = LedgerStoreRegistry(self._client)
            else:
                self._stores = _local_stores(self.host_budget)
        return self._stores

    def process_memory_fraction(self) -> float | None:
        """The share as a fraction of the GPU's memory (torch.cuda.set_per_process_memory_fraction); None: no GPU."""
        return None if self.gpu is None else min(1.0, self.share_bytes / self.gpu.memory_bytes)

    def neighbour_leases(self):
        """Bytes other processes leased on this replica's GPU and do not hold yet, kept fresh by the
        ledger client's heartbeat (cluster/replica/neighbours.py): a provider for ``Device.set_neighbours``.
        None without a GPU pool, or without Ray (the in-process ledger knows no other process)."""
        from cluster.replica.neighbours import neighbour_leases

        provider = neighbour_leases(self.device_pool, self.gpu) if self._client is not None else None
        self._neighbours = provider
        if provider is not None:
            self._client.watch_pool(self.device_pool, provider.refresh)
            logger.info("%s: headroom on %s leaves neighbours' outstanding leases alone (%d B now, %s)",
                        self.owner, self.device_pool, provider(),
                        "NVML per process" if self.gpu.source.startswith("nvml") else "fake GPU: whole leases")
        return provider

    def device_leases(self, *, to_driver=None, idle_s: float | None = None, headroom=None):
        """This replica's standing lease and call reservation on its device pool (cluster.replica.device_leases);
        ``headroom``: reads the device's headroom for reports."""
        from cluster.replica.device_leases import DEFAULT_IDLE_S, DeviceLeases

        return DeviceLeases(self.device_budget, self.owner, self.device_pool, to_driver=to_driver,
                            idle_s=DEFAULT_IDLE_S if idle_s is None else idle_s, headroom=headroom)

    @classmethod
    def open(cls, owner: str, device: "torch.device | str" = "cpu", *,
             config: LedgerConfig = LedgerConfig()) -> "ReplicaMemory":
        """The replica's budgets from its node's ledger; without Ray, from :meth:`open_local`."""
        import ray

        device = as_device(device)
        if not ray.is_initialized():
            return cls.open_local(owner, device, config=config)
        from cluster.ledger.actor import node_ledger
        from cluster.replica.ledger_client import LedgerClient

        node = probe_node()
        # Ray's ids are numbers, or UUIDs where CUDA_VISIBLE_DEVICES names GPUs that way (MIG, some k8s).
        assigned = visible_gpu_indices(ray.get_gpu_ids(), node.gpus)
        gpu = _pick_gpu(device, assigned, node.gpus, owner)
        client = LedgerClient(node_ledger(node.node_id, config), owner, config)
        pool = gpu_pool(gpu.index) if gpu is not None else HOST_POOL
        profile = profile_for_gpu(gpu)
        logger.info("%s: node ledger of %s (epoch %s); host pool %s, device %s leases pool %s; profile %s",
                    owner, node.node_id, client.epoch, HOST_POOL, device, pool, profile.name)
        return cls(owner, device, node, profile, client.budget(HOST_POOL), client.budget(pool), pool, client,
                   gpu, assigned_gpu_fraction() if gpu is not None else None)

    @classmethod
    def open_local(cls, owner: str, device: "torch.device | str" = "cpu", *,
                   config: LedgerConfig = LedgerConfig(), node: NodeInfo | None = None,
                   gpu_fraction: float | None = None, assigned: tuple[int, ...] = ()) -> "ReplicaMemory":
        """Process-local ledgers (what :meth:`open` uses without Ray); ``node`` is injectable for tests,
        ``assigned`` GPUs too (a CPU replica then stands in for the first, as under Ray)."""
        device = as_device(device)
        node = node or probe_node(resources={}, reserve=config.reserve_bytes)
        visible = cuda_visible_ids()
        if device.type == "cuda" and not assigned and visible is not None:
            # cuda:0 is the first GPU CUDA_VISIBLE_DEVICES names, not NVML's GPU 0.
            assigned = tuple(visible_gpu_indices(visible, node.gpus))
        gpu = _pick_gpu(device, list(assigned), node.gpus, owner)
        profile = profile_for_gpu(gpu)
        spendable = node.ram.spendable
        host = _local_pool(HOST_POOL, spendable)
        pool = gpu_pool(gpu.index) if gpu is not None else HOST_POOL
        dev = _local_pool(pool, profile.device_pool_bytes(gpu)) if gpu is not None else host
        logger.info("%s: Ray is not initialised, so an in-process ledger stands in for the node ledger "
                    "(host %.2f GB spendable, device %s leases pool %s of %.2f GB): other processes on "
                    "this node are not accounted", owner, host.capacity() / GB, device, pool, dev.capacity() / GB)
        return cls(owner, device, node, profile, host, dev, pool, gpu=gpu, gpu_fraction=gpu_fraction)

    def close(self) -> int:
        """Give back every lease this replica holds. Returns the bytes released; 0 when closed before.

        Once only: a stage deployment's ``__del__`` closes its worker again when the object is
        collected, at any later moment; in one process the in-process ledger keys leases by owner
        name, so that second release took the leases of a live replica of the same stage (the
        suite's "lease host-85 of local-denoise is not outstanding", at 84ed7e3)."""
        if self._closed:
            return 0
        self._closed = True
        if self._neighbours is not None:
            self._neighbours.close()
        if self._client is not None:
            return self._client.close()
        freed = self.host_budget.release_owner(self.owner)
        if self.device_budget is not self.host_budget:
            freed += self.device_budget.release_owner(self.owner)
        return freed
