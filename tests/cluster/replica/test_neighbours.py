"""Neighbours' outstanding leases on a GPU: leased minus held, per process, learned on the heartbeat."""
from __future__ import annotations

import asyncio
import subprocess
import time
from types import SimpleNamespace

import psutil
import ray

from cluster.ledger.actor import node_ledger
from cluster.ledger.liveness import OwnerRef
from cluster.ledger.pools import LeasePools
from cluster.node import GpuInfo
from cluster.replica.ledger_client import LedgerClient
from cluster.replica.neighbours import NeighbourLeases, neighbour_leases, nvml_used_by_process
from tests.cluster.conftest import FAST, MiB

ME = 100


def test_a_fake_gpu_counts_a_neighbours_whole_lease():
    leases = NeighbourLeases("gpu:0", None, pid=ME)
    assert leases.refresh(((ME, 50 * MiB), (200, 30 * MiB), (300, 5 * MiB))) == 35 * MiB
    assert leases() == 35 * MiB, "reading it is the cached figure"


def test_a_neighbour_counts_what_it_leased_and_does_not_hold_yet():
    used = {ME: 900 * MiB, 200: 10 * MiB, 300: 80 * MiB}
    leases = NeighbourLeases("gpu:0", lambda: used, pid=ME)
    # 200 leased 30 and holds 10: 20 outstanding; 300 holds more than it leased (its CUDA context): 0.
    assert leases.refresh(((ME, 50 * MiB), (200, 30 * MiB), (300, 40 * MiB))) == 20 * MiB
    assert (leases.leased, leases.held) == (70 * MiB, 50 * MiB)


def test_this_processs_own_leases_are_never_its_neighbours():
    leases = NeighbourLeases("gpu:0", None, pid=ME)
    assert leases.refresh(((ME, 50 * MiB),)) == 0


def test_nvml_pids_of_another_pid_namespace_are_taken_together():
    used = {7001: 25 * MiB, 7002: 5 * MiB}  # the host's pids: neither ours nor the ledger's
    leases = NeighbourLeases("gpu:0", lambda: used, pid=ME)
    assert leases.refresh(((ME, 10 * MiB), (200, 40 * MiB), (300, 10 * MiB))) == 20 * MiB


def test_nvml_used_by_process_reads_the_compute_processes_of_the_gpu_named_by_uuid():
    calls = []
    fake = SimpleNamespace(
        nvmlInit=lambda: calls.append("init"), nvmlShutdown=lambda: calls.append("shutdown"),
        nvmlDeviceGetHandleByUUID=lambda uuid: calls.append(uuid) or "handle",
        nvmlDeviceGetComputeRunningProcesses=lambda handle: [SimpleNamespace(pid=1, usedGpuMemory=5),
                                                             SimpleNamespace(pid=2, usedGpuMemory=None)])
    gpu = GpuInfo(0, "H200", 10, 5, 16, "nvml", "GPU-abc")
    assert nvml_used_by_process(gpu, fake)() == {1: 5, 2: 0}
    assert calls == ["init", "GPU-abc", "shutdown"]


def test_only_a_gpu_pool_gets_a_provider_and_a_fake_gpu_sees_no_nvml():
    assert neighbour_leases("host", None) is None
    fake_gpu = neighbour_leases("gpu:0", GpuInfo(0, "L4", 24 * 10**9, 4, 16, "injected:test"))
    assert fake_gpu is not None and fake_gpu._used is None


def test_the_pools_sum_leases_per_owner_process():
    async def run():
        pools = LeasePools({"gpu:0": 100 * MiB})
        a, b = (OwnerRef(f"r{pid}", None, None, pid, 0.0) for pid in (11, 22))
        await pools.request("gpu:0", 10 * MiB, a)
        await pools.request("gpu:0", 5 * MiB, a, owner="r11-call")
        await pools.request("gpu:0", 30 * MiB, b)
        return pools.leased_by_process("gpu:0")

    assert asyncio.run(run()) == ((11, 15 * MiB), (22, 30 * MiB))


def _until(condition, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.05)
    return condition()


def test_a_replica_learns_a_neighbours_lease_on_its_heartbeat(fleet_nodes):
    node = fleet_nodes.l4
    handle = node_ledger(node.node_id, FAST)
    client = LedgerClient(handle, "watcher", FAST)
    neighbour = subprocess.Popen(["sleep", "60"])  # a live process on this node: liveness keeps its lease
    try:
        leases = NeighbourLeases("gpu:0", None)
        client.watch_pool("gpu:0", leases.refresh)
        assert leases() == 0, "read once when watching starts"
        ref = OwnerRef("next-door", node.node_id, None, neighbour.pid, psutil.Process(neighbour.pid).create_time())
        lease = ray.get(handle.request.remote("gpu:0", 30 * MiB, ref, 0.0, "call:next-door"))
        assert _until(lambda: leases() == 30 * MiB), "the heartbeat (0.5 s here) carries the neighbour's lease"
        ray.get(handle.release.remote("gpu:0", lease.lease_id))
        assert _until(lambda: leases() == 0)
    finally:
        client.close()
        neighbour.kill()
        neighbour.wait()


def test_a_replicas_device_leaves_a_neighbour_replicas_leases_alone_until_they_go(fleet_nodes):
    from tests.cluster.replicas import on_node

    GB = 10**9
    node = fleet_nodes.small  # a fake "12 GB" RTX3060: the CPU stands in, so all of a lease counts
    watcher, neighbour = (on_node(node.node_id, num_gpus=0.5).remote(name, FAST) for name in ("watcher", "next"))
    try:
        ray.get(watcher.watch_neighbours.remote())
        assert ray.get(watcher.neighbours_outstanding.remote()) == 0
        # Standing 1 + kept 3, kept 600 s unused (not 10: a loaded machine's polls can outlast that).
        assert ray.get(neighbour.reserved_call.remote(GB, 3 * GB, 0.0, 10, 600.0))[0] == "ok"
        assert _until(lambda: ray.get(watcher.neighbours_outstanding.remote()) == 4 * GB)
        ray.get(neighbour.close.remote())
        assert _until(lambda: ray.get(watcher.neighbours_outstanding.remote()) == 0)
    finally:
        for replica in (watcher, neighbour):
            ray.get(replica.close.remote())
            ray.kill(replica)
