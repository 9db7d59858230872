"""Fleet profiles: a replica picks its profile from the GPU it sees."""
from __future__ import annotations

import pytest

from cluster.fleet import FLEET_YAML, load_fleet, profile_for_gpu
from cluster.node import GB, GpuInfo


def _gpu(name: str, memory_gb: float) -> GpuInfo:
    return GpuInfo(0, name, int(memory_gb * GB), 4, 16, "test")


@pytest.mark.parametrize("name, memory_gb, profile", [
    ("NVIDIA GeForce RTX 3060", 12.88, "consumer-12gb"),
    ("NVIDIA L4", 24.15, "l4-a10g-24gb"),
    ("NVIDIA A10G", 23.8, "l4-a10g-24gb"),
    ("NVIDIA L40S", 48.3, "l40s-48gb"),  # "L4" must not match "L40S"
    ("NVIDIA H100 80GB HBM3", 85.5, "a100-h100-80gb"),
    ("NVIDIA A100-SXM4-80GB", 85.1, "a100-h100-80gb"),
    ("NVIDIA H200", 150.0, "h200-141gb"),
    ("NVIDIA RTX A5000", 25.4, "l4-a10g-24gb"),  # unlisted: by memory class
    ("NVIDIA A100-SXM4-40GB", 42.5, "l4-a10g-24gb"),  # below the 48 GB class
])
def test_a_replica_picks_its_profile_from_the_gpu_it_sees(name, memory_gb, profile):
    assert profile_for_gpu(_gpu(name, memory_gb)).name == profile


def test_the_fleet_covers_every_class_and_no_gpu():
    fleet = load_fleet()
    assert [p.min_memory_gb for p in fleet.profiles] == [12, 24, 48, 80, 141]
    assert profile_for_gpu(None).name == fleet.cpu_profile.name
    modes = {p.name: p.mode for p in fleet.profiles}
    assert modes["consumer-12gb"] == "MEMORY" and modes["a100-h100-80gb"] == "SPEED"


def test_a_bad_fleet_file_is_named(tmp_path):
    text = FLEET_YAML.read_text()
    good, bad, typo = tmp_path / "ok.yaml", tmp_path / "bad.yaml", tmp_path / "typo.yaml"
    good.write_text(text)
    assert load_fleet(good).by_name("h200-141gb").min_memory_gb == 141
    bad.write_text(text.replace("mode: SPEED", "mode: TURBO", 1))
    with pytest.raises(ValueError, match="mode 'TURBO' is not one of"):
        load_fleet(bad)
    typo.write_text(text.replace("prefetch_depth: 1", "prefetch_dept: 1", 1))
    with pytest.raises(ValueError, match=r"unknown keys \['prefetch_dept'\]"):
        load_fleet(typo)


def test_every_gpu_of_the_real_table_gets_the_largest_class_it_reaches():
    from cluster.node import fake_gpus
    from offload_core.planner.gpus import gpu_names

    for name in gpu_names():
        (gpu,) = fake_gpus(name, 1, "test")
        memory = gpu.memory_bytes
        profile = profile_for_gpu(gpu)
        classes = [p.min_memory_gb for p in load_fleet().profiles if p.min_memory_gb * GB <= memory]
        assert profile.min_memory_gb == max(classes), f"{name} ({memory / GB:.0f} GB) got {profile.name}"
