"""How much host RAM this process may still spend: psutil, the cgroup chain, and a reserve.

``psutil.virtual_memory().available`` sees the whole machine, but a container's memory cgroup
may cap it far lower (and the OOM killer acts on the cgroup, not the machine). So the figure is

    spendable = min(psutil available, tightest (limit - usage) along this process's cgroup chain)
                - reserve - reserved_elsewhere

where the reserve (default max(5 % of total, 2 GiB)) keeps the kernel, page cache and the
Python heap breathing, and ``reserved_elsewhere`` is what the caller knows is promised to someone
else (Ray's object store takes 30 % of node memory by default). The roots of /proc and of the
cgroup file system are parameters so tests can build fake trees in a temporary folder.
"""
from __future__ import annotations

import enum
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, NamedTuple

import psutil

logger = logging.getLogger(__name__)

GiB = 1024**3
# cgroup v1 writes "no limit" as the largest page-aligned signed 64-bit value
# (9223372036854771712); anything at or above 2**62 is treated as no cap.
_NO_CAP_THRESHOLD = 2**62
_DEFAULT_RESERVE_FRACTION = 0.05
_DEFAULT_RESERVE_FLOOR = 2 * GiB


class Bound(enum.Enum):
    # The machine-wide figure psutil reports (MemAvailable) was the tighter one.
    PSUTIL = "psutil"
    # A cgroup v1 memory controller (memory.limit_in_bytes - memory.usage_in_bytes) was tighter.
    CGROUP_V1 = "cgroup-v1"
    # A cgroup v2 group (memory.max - memory.current) was tighter.
    CGROUP_V2 = "cgroup-v2"


@dataclass(frozen=True)
class CgroupHeadroom:
    """One capped memory cgroup on this process's chain."""

    version: int
    path: str  # the group's folder, for logs
    limit: int
    usage: int

    @property
    def headroom(self) -> int:
        return max(0, self.limit - self.usage)


@dataclass(frozen=True)
class HostRam:
    """The host-RAM facts one decision was made from, and the figure it may spend."""

    total: int
    psutil_available: int
    # The tightest capped cgroup on the chain, or None when no group on it has a limit.
    cgroup: CgroupHeadroom | None
    reserve: int
    reserved_elsewhere: int
    spendable: int
    bound: Bound

    def log_line(self) -> str:
        cg = ("no capped cgroup" if self.cgroup is None else
              f"cgroup v{self.cgroup.version} {self.cgroup.path}: limit {_gib(self.cgroup.limit)} "
              f"usage {_gib(self.cgroup.usage)}")
        return (f"host RAM spendable {_gib(self.spendable)} (bound by {self.bound.value}): "
                f"psutil available {_gib(self.psutil_available)} of {_gib(self.total)}, {cg}, "
                f"reserve {_gib(self.reserve)}, reserved elsewhere {_gib(self.reserved_elsewhere)}")


class MemoryReading(NamedTuple):
    """The two psutil figures used; tests pass their own instead of the machine's."""

    total: int
    available: int


def _psutil_facts() -> MemoryReading:
    vm = psutil.virtual_memory()
    return MemoryReading(int(vm.total), int(vm.available))


def default_reserve(total: int) -> int:
    """max(5 % of total, 2 GiB): below ~2 GiB free a Linux host starts thrashing its page cache."""
    return max(int(total * _DEFAULT_RESERVE_FRACTION), _DEFAULT_RESERVE_FLOOR)


def host_ram_available(
    reserve: int | None = None,
    reserved_elsewhere: int = 0,
    *,
    proc_root: str | os.PathLike = "/proc",
    cgroup_root: str | os.PathLike = "/sys/fs/cgroup",
    memory_facts: Callable[[], MemoryReading] = _psutil_facts,
) -> HostRam:
    """What this process may spend on host memory now; see the module docstring for the formula."""
    if reserved_elsewhere < 0:
        raise ValueError(f"reserved_elsewhere must be >= 0, got {reserved_elsewhere}")
    if reserve is not None and reserve < 0:
        raise ValueError(f"reserve must be >= 0, got {reserve}")
    facts = memory_facts()
    reserve = default_reserve(facts.total) if reserve is None else int(reserve)
    cgroup = tightest_cgroup(Path(proc_root), Path(cgroup_root))
    ceiling, bound = facts.available, Bound.PSUTIL
    if cgroup is not None and cgroup.headroom < ceiling:
        ceiling = cgroup.headroom
        bound = Bound.CGROUP_V2 if cgroup.version == 2 else Bound.CGROUP_V1
    spendable = max(0, ceiling - reserve - int(reserved_elsewhere))
    ram = HostRam(int(facts.total), int(facts.available), cgroup, reserve, int(reserved_elsewhere),
                  spendable, bound)
    logger.info(ram.log_line())
    return ram


def tightest_cgroup(proc_root: Path, cgroup_root: Path) -> CgroupHeadroom | None:
    """The capped memory cgroup with the least headroom along this process's chain (v1 and v2)."""
    capped = [g for g in _chain(proc_root, cgroup_root) if g is not None]
    return min(capped, key=lambda g: g.headroom, default=None)


def _chain(proc_root: Path, cgroup_root: Path):
    """Every group from this process's own up to the hierarchy root, for each memory hierarchy."""
    try:
        lines = (proc_root / "self" / "cgroup").read_text().splitlines()
    except FileNotFoundError:
        return
    for line in lines:
        hierarchy_id, controllers, rel = line.split(":", 2)
        if hierarchy_id == "0" and controllers == "":
            mount, version = _v2_mount(cgroup_root), 2
        elif "memory" in controllers.split(","):
            mount, version = cgroup_root / controllers, 1
        else:
            continue
        if mount is None:
            continue
        # Inside a cgroup namespace the listed path may not exist under the mount (the mount is
        # the container's own group); every ancestor that does exist is still checked.
        parts = [p for p in rel.strip("/").split("/") if p]
        for depth in range(len(parts), -1, -1):
            folder = mount.joinpath(*parts[:depth])
            if folder.is_dir():
                yield _read_group(folder, version)


def _v2_mount(cgroup_root: Path) -> Path | None:
    # Pure v2 hosts mount the unified tree at the root; hybrid hosts at <root>/unified.
    for candidate in (cgroup_root, cgroup_root / "unified"):
        if (candidate / "cgroup.controllers").exists():
            return candidate
    return None


def _read_group(folder: Path, version: int) -> CgroupHeadroom | None:
    names = ("memory.max", "memory.current") if version == 2 else (
        "memory.limit_in_bytes", "memory.usage_in_bytes")
    limit = _read_bytes(folder / names[0])
    if limit is None:
        return None
    usage = _read_bytes(folder / names[1]) or 0
    return CgroupHeadroom(version, str(folder), limit, usage)


def _read_bytes(path: Path) -> int | None:
    """An integer file; None for a missing file, "max", or a v1 'unlimited' huge value."""
    try:
        text = path.read_text().strip()
    except (FileNotFoundError, PermissionError):
        return None
    if text == "max":
        return None
    value = int(text)
    return None if value >= _NO_CAP_THRESHOLD else value


def _gib(nbytes: int) -> str:
    return f"{nbytes / GiB:.2f} GiB"
