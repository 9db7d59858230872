"""GPUs named by index, UUID or MIG instance: NVML's MIG handles, Ray's ids, CUDA_VISIBLE_DEVICES."""
from __future__ import annotations

from dataclasses import dataclass

import pytest

from cluster.ledger.actor import LedgerConfig
from cluster.node import GB, GpuInfo, NodeInfo, cuda_visible_ids, probe_host_ram, probe_nvml_gpus, visible_gpu_indices
from cluster.replica.ledger_view import ReplicaMemory


@dataclass
class _Mem:
    total: int


class FakeNvml:
    """pynvml's calls probe_nvml_gpus makes: card 0 a plain H100, card 1 an A100 in MIG mode (two 10 GB instances)."""

    NVML_DEVICE_MIG_ENABLE = 1

    class NVMLError(Exception):
        pass

    cards = {0: ("NVIDIA H100 80GB HBM3", 80 * GB, "GPU-aaaa", None),
             1: ("NVIDIA A100-SXM4-40GB", 40 * GB, "GPU-bbbb", [("NVIDIA A100-SXM4-40GB MIG 1g.10gb", 10 * GB,
                                                                  "MIG-1111"), None,
                                                                 ("NVIDIA A100-SXM4-40GB MIG 1g.10gb", 10 * GB,
                                                                  "MIG-2222")])}

    def nvmlInit(self): pass
    def nvmlShutdown(self): pass
    def nvmlDeviceGetCount(self): return len(self.cards)
    def nvmlDeviceGetHandleByIndex(self, i): return ("card", i)
    def nvmlDeviceGetMaxPcieLinkGeneration(self, h): return 5
    def nvmlDeviceGetMaxPcieLinkWidth(self, h): return 16

    def _spec(self, h):
        if h[0] == "card":
            return self.cards[h[1]][:3]
        return self.cards[h[1]][3][h[2]]

    def nvmlDeviceGetName(self, h): return self._spec(h)[0].encode()
    def nvmlDeviceGetMemoryInfo(self, h): return _Mem(self._spec(h)[1])
    def nvmlDeviceGetUUID(self, h): return self._spec(h)[2]

    def nvmlDeviceGetMigMode(self, h):
        if self.cards[h[1]][3] is None:
            raise self.NVMLError("Not Supported")
        return (1, 1)

    def nvmlDeviceGetMaxMigDeviceCount(self, h): return len(self.cards[h[1]][3])

    def nvmlDeviceGetMigDeviceHandleByIndex(self, h, j):
        if self.cards[h[1]][3][j] is None:
            raise self.NVMLError("Not Found")
        return ("mig", h[1], j)


def test_a_card_in_mig_mode_is_listed_as_its_instances_with_their_own_memory():
    gpus = probe_nvml_gpus(FakeNvml())
    assert [(g.index, g.uuid, g.memory_bytes) for g in gpus] == [
        (0, "GPU-aaaa", 80 * GB), (2, "MIG-1111", 10 * GB), (3, "MIG-2222", 10 * GB)]
    assert gpus[1].source == "nvml:mig" and "MIG 1g.10gb" in gpus[1].name


def test_gpus_named_by_index_or_uuid_prefix_map_to_the_nodes_gpus():
    gpus = probe_nvml_gpus(FakeNvml())
    assert visible_gpu_indices([0], gpus) == [0]
    assert visible_gpu_indices(["MIG-2222", "GPU-aaaa"], gpus) == [3, 0]
    assert visible_gpu_indices(["MIG-11"], gpus) == [2], "CUDA accepts a unique UUID prefix"
    with pytest.raises(LookupError, match="'GPU-zzzz' matches 0"):
        visible_gpu_indices(["GPU-zzzz"], gpus)
    with pytest.raises(LookupError, match="'1' matches 0"):
        visible_gpu_indices(["1"], gpus)  # card 1 is split into MIG instances: name one of them


def test_cuda_visible_devices_decides_which_gpu_a_local_cuda_replica_leases():
    assert cuda_visible_ids({}) is None and cuda_visible_ids({"CUDA_VISIBLE_DEVICES": "MIG-2222, 0"}) == [
        "MIG-2222", "0"]
    gpus = probe_nvml_gpus(FakeNvml())
    node = NodeInfo(None, probe_host_ram(), False, gpus, None, 0)
    memory = ReplicaMemory.open_local("mig-replica", "cuda:0", config=LedgerConfig(), node=node, assigned=(3,))
    assert memory.device_pool == "gpu:3" and memory.gpu.memory_bytes == 10 * GB


def test_a_local_cuda_replica_reads_cuda_visible_devices(monkeypatch):
    gpus = (GpuInfo(0, "NVIDIA L4", 24 * GB, 4, 16, "nvml", "GPU-0000"),
            GpuInfo(1, "NVIDIA L4", 24 * GB, 4, 16, "nvml", "GPU-1111"))
    node = NodeInfo(None, probe_host_ram(), False, gpus, None, 0)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-1111")
    memory = ReplicaMemory.open_local("second-card", "cuda:0", config=LedgerConfig(), node=node)
    assert memory.device_pool == "gpu:1", "cuda:0 is the first visible GPU, NVML's GPU 1"
