"""Node facts: NVML absent is 'no GPUs', injected facts stand in for a node's RAM and GPUs."""
from __future__ import annotations

import pynvml
import pytest

from cluster.node import (
    GB,
    GpuInfo,
    fake_gpus,
    injected_facts,
    probe_node,
    probe_nvml_gpus,
)


def test_a_node_without_an_nvidia_driver_has_no_gpus(monkeypatch):
    def no_driver():
        raise pynvml.NVMLError(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)

    monkeypatch.setattr(pynvml, "nvmlInit", no_driver)
    assert probe_nvml_gpus() == ()


def test_gpu_types_are_sized_from_the_real_gpu_table():
    (l4,) = fake_gpus("L4", 1, "test")
    assert (l4.memory_bytes, l4.pcie_gen, l4.pcie_width) == (24 * 2**30, 4, 16)  # the table's GiB
    assert fake_gpus("H100", 2, "test")[1].pcie_gen == 5
    assert fake_gpus("A100-80G", 1, "test")[0].name == "A100-80GB"  # Ray's name for it
    with pytest.raises(ValueError, match="unknown GPU type 'B9000'"):
        fake_gpus("B9000", 1, "test")


def test_injected_node_resources_give_ram_and_gpus():
    ram, gpus = injected_facts({"offload_fake_ram_gb": 8, "GPU": 2, "accelerator_type:RTX3060": 1})
    assert ram == 8 * GB and [g.name for g in gpus] == ["RTX3060", "RTX3060"]
    assert injected_facts({"CPU": 4}) == (None, ())


def test_spendable_ram_is_available_less_reserve_and_object_store():
    node = probe_node(resources={"offload_fake_ram_gb": 16, "object_store_memory": 10**9}, nvml_gpus=(),
                      reserve=2 * GB)
    assert node.ram_injected and node.ram.spendable == 16 * GB - 2 * GB - 10**9
    assert node.object_store_bytes == 10**9 and node.gpus == ()


def test_real_nvml_gpus_win_over_injected_ones():
    seen = (GpuInfo(0, "NVIDIA H200", 150 * GB, 5, 16, "nvml"),)
    node = probe_node(resources={"GPU": 1, "accelerator_type:L4": 1}, nvml_gpus=seen)
    assert node.gpus == seen and node.accelerator_type == "L4"
