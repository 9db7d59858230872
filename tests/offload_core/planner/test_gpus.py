"""The one GPU table: memory, link and compute rate per GPU model, read from the config file only."""
from __future__ import annotations

import pathlib

import pytest

from offload_core.planner.gpus import gpu_model, gpu_names, link_Bps, parse_link
from offload_core.planner.real_models import UnknownModel

ROOT = pathlib.Path(__file__).resolve().parents[3]


def test_gpu_models_carry_memory_link_and_compute_rate():
    h100, l4 = gpu_model("H100"), gpu_model("L4")
    assert h100.memory_bytes == 80 * 2**30 and h100.pinned_Bps == 40e9 and (h100.pcie_gen, h100.pcie_width) == (5, 16)
    assert l4.memory_gb == 24 and l4.pinned_Bps == 25e9 and l4.dense_bf16_flops == 121e12
    assert gpu_model("A100-40GB").pinned_Bps == 25e9  # the link string carries a note after the lanes
    assert gpu_model("A100-80G").name == "A100-80GB"  # Ray's accelerator_type for it
    assert {"RTX3060", "L4", "A10G", "L40S", "A100-80GB", "H100", "H200"} <= set(gpu_names())
    with pytest.raises(UnknownModel, match="H200"):
        gpu_model("B200")


def test_link_bandwidth_scales_with_lanes_and_unmeasured_generations():
    assert link_Bps(4, 16) == (25e9, 8e9)  # measured pinned; pageable measured, whatever the link
    assert link_Bps(4, 8)[0] == 12.5e9
    assert link_Bps(3, 16)[0] == 12.5e9  # a generation halves the lane rate
    assert link_Bps() == link_Bps(4, 16)  # no link facts: the table's default link
    assert parse_link("PCIe Gen5 x16 (SXM)") == (5, 16) and parse_link("NVLink") == (None, None)


def test_every_fleet_profile_names_a_gpu_of_the_table():
    # A profile's accelerator_type is how fake nodes and the k8s worker groups find their GPU facts.
    import yaml

    fleet = yaml.safe_load((ROOT / "configs" / "fleet" / "fleet.yaml").read_text())
    for profile in fleet["profiles"]:
        model = gpu_model(profile["accelerator_type"])
        assert model.memory_gb >= profile["min_memory_gb"], f"{profile['name']}: {model.name} is below its class"
