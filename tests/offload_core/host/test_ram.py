"""host_ram_available on fake /proc and cgroup trees: which constraint binds, and by how much."""
from __future__ import annotations

from pathlib import Path

import pytest

from offload_core.host.ram import (
    Bound,
    GiB,
    MemoryReading,
    default_reserve,
    host_ram_available,
)

V1_UNLIMITED = "9223372036854771712"


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def _facts(total_gib: float, available_gib: float):
    return lambda: MemoryReading(int(total_gib * GiB), int(available_gib * GiB))


def _v2_tree(tmp_path: Path, groups: dict[str, tuple[str, int]], rel: str) -> tuple[Path, Path]:
    """groups: path below the root -> (memory.max text, memory.current bytes)."""
    proc, cg = tmp_path / "proc", tmp_path / "cgroup"
    _write(proc / "self" / "cgroup", f"0::{rel}\n")
    _write(cg / "cgroup.controllers", "cpu memory\n")
    for sub, (limit, usage) in groups.items():
        folder = cg / sub.strip("/") if sub.strip("/") else cg
        _write(folder / "memory.max", limit + "\n")
        _write(folder / "memory.current", f"{usage}\n")
    return proc, cg


def test_psutil_binds_when_no_cgroup_caps(tmp_path):
    proc, cg = _v2_tree(tmp_path, {"/kubepods/pod1": ("max", 3 * GiB)}, "/kubepods/pod1")
    ram = host_ram_available(reserve=GiB, proc_root=proc, cgroup_root=cg, memory_facts=_facts(64, 40))
    assert ram.bound is Bound.PSUTIL
    assert ram.cgroup is None, "a 'max' limit is no cap and must not be reported as the binding group"
    assert ram.spendable == 39 * GiB


def test_tightest_v2_group_along_the_chain_binds(tmp_path):
    # The parent has the tighter headroom (10 - 8 = 2 GiB) even though the leaf's limit is lower.
    groups = {"/kubepods": (str(10 * GiB), 8 * GiB), "/kubepods/pod1": (str(6 * GiB), 1 * GiB)}
    proc, cg = _v2_tree(tmp_path, groups, "/kubepods/pod1")
    ram = host_ram_available(reserve=0, proc_root=proc, cgroup_root=cg, memory_facts=_facts(64, 40))
    assert ram.bound is Bound.CGROUP_V2
    assert ram.cgroup.limit == 10 * GiB and ram.cgroup.usage == 8 * GiB
    assert ram.spendable == 2 * GiB


def test_v1_memory_controller_on_a_hybrid_host(tmp_path):
    proc, cg = tmp_path / "proc", tmp_path / "cgroup"
    _write(proc / "self" / "cgroup", "9:name=systemd:/\n4:memory:/process_api/abc\n0::/\n")
    _write(cg / "unified" / "cgroup.controllers", "")
    _write(cg / "memory" / "memory.limit_in_bytes", V1_UNLIMITED)
    _write(cg / "memory" / "memory.usage_in_bytes", str(20 * GiB))
    _write(cg / "memory" / "process_api" / "abc" / "memory.limit_in_bytes", str(12 * GiB))
    _write(cg / "memory" / "process_api" / "abc" / "memory.usage_in_bytes", str(5 * GiB))
    ram = host_ram_available(reserve=GiB, reserved_elsewhere=GiB, proc_root=proc, cgroup_root=cg,
                             memory_facts=_facts(64, 40))
    assert ram.bound is Bound.CGROUP_V1
    assert ram.cgroup.path.endswith("process_api/abc")
    assert ram.spendable == (12 - 5 - 1 - 1) * GiB


def test_v1_huge_limit_means_no_cap(tmp_path):
    proc, cg = tmp_path / "proc", tmp_path / "cgroup"
    _write(proc / "self" / "cgroup", "4:memory:/\n")
    _write(cg / "memory" / "memory.limit_in_bytes", V1_UNLIMITED)
    _write(cg / "memory" / "memory.usage_in_bytes", str(30 * GiB))
    ram = host_ram_available(reserve=0, proc_root=proc, cgroup_root=cg, memory_facts=_facts(64, 40))
    assert ram.bound is Bound.PSUTIL and ram.spendable == 40 * GiB


def test_namespaced_path_missing_under_the_mount_still_checks_the_mount_root(tmp_path):
    # In a cgroup namespace /proc/self/cgroup names a host path the container cannot see; the
    # container's own group is mounted at the root, and its limit must still apply.
    proc, cg = _v2_tree(tmp_path, {"/": (str(8 * GiB), 7 * GiB)}, "/host/side/path")
    ram = host_ram_available(reserve=0, proc_root=proc, cgroup_root=cg, memory_facts=_facts(64, 40))
    assert ram.bound is Bound.CGROUP_V2 and ram.spendable == GiB


def test_default_reserve_is_five_percent_with_a_two_gib_floor(tmp_path):
    assert default_reserve(16 * GiB) == 2 * GiB
    assert default_reserve(1000 * GiB) == 50 * GiB
    proc, cg = _v2_tree(tmp_path, {}, "/")
    ram = host_ram_available(proc_root=proc, cgroup_root=cg, memory_facts=_facts(100, 30))
    assert ram.reserve == 5 * GiB and ram.spendable == 25 * GiB


def test_spendable_never_goes_negative_and_bad_reservations_are_refused(tmp_path):
    proc, cg = _v2_tree(tmp_path, {}, "/")
    ram = host_ram_available(reserve=GiB, reserved_elsewhere=10 * GiB, proc_root=proc, cgroup_root=cg,
                             memory_facts=_facts(16, 4))
    assert ram.spendable == 0
    with pytest.raises(ValueError, match="reserved_elsewhere"):
        host_ram_available(reserved_elsewhere=-1, proc_root=proc, cgroup_root=cg)


def test_the_decision_is_logged_with_its_numbers(tmp_path, caplog):
    proc, cg = _v2_tree(tmp_path, {"/a": (str(4 * GiB), GiB)}, "/a")
    with caplog.at_level("INFO", logger="offload_core.host.ram"):
        host_ram_available(reserve=0, proc_root=proc, cgroup_root=cg, memory_facts=_facts(64, 40))
    assert "bound by cgroup-v2" in caplog.text and "3.00 GiB" in caplog.text


def test_this_machine_gives_a_plausible_figure():
    ram = host_ram_available()
    assert 0 <= ram.spendable <= ram.psutil_available <= ram.total
