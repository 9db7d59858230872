"""Fleet profiles: the mode and planner limits for each GPU type (configs/fleet/fleet.yaml).

A replica picks its profile from the GPU it sees: by name first (NVML names such as
"NVIDIA L4", "NVIDIA H100 80GB HBM3"), else by memory class, so an unlisted 24 GB card still
gets the 24 GB profile. A node without GPUs gets the CPU profile.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import yaml

from cluster.node import GB, GpuInfo

logger = logging.getLogger(__name__)

FLEET_YAML = Path(__file__).resolve().parents[1] / "configs" / "fleet" / "fleet.yaml"
MODES = ("SPEED", "BALANCED", "MEMORY", "AUTO")  # offload_core.planner.search.PerformanceMode names
# NVML reports a little less or more than the nominal size (a "24 GB" L4: 23034 MiB = 24.15 GB;
# an "80 GB" A100-40GB-class card never reaches 72). 10 % tolerance keeps each card in its class.
MEMORY_TOLERANCE = 0.9


@dataclass(frozen=True)
class FleetProfile:
    name: str  # the profile's name, in the replica's log line
    match: tuple[str, ...]  # GPU name fragments, matched on whole words ("L4" never matches "L40S")
    min_memory_gb: float  # a GPU no name matches takes the largest profile whose min_memory_gb it reaches
    accelerator_type: str | None  # Ray accelerator_type resource for placing stages here
    mode: str  # a PerformanceMode name: the stage's mode when its offload_mode is left null
    max_resident_fraction: float  # most of a streamed component's layers kept on the device
    prefetch_depth: int  # layers in flight ahead of compute
    host_pin_cap_fraction: float  # most of the node's spendable host RAM one replica may pin
    # device memory kept out of the ledger's GPU pool (CUDA context, allocator fragmentation)
    device_reserve_fraction: float

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"fleet profile {self.name}: mode {self.mode!r} is not one of {MODES}")
        for name in ("max_resident_fraction", "host_pin_cap_fraction", "device_reserve_fraction"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"fleet profile {self.name}: {name}={getattr(self, name)} is not a fraction")
        if self.prefetch_depth < 1:
            raise ValueError(f"fleet profile {self.name}: prefetch_depth must be >= 1, got {self.prefetch_depth}")

    def performance_mode(self):
        """The planner's PerformanceMode member for this profile's mode."""
        from offload_core.planner.search import PerformanceMode

        return PerformanceMode[self.mode]

    def device_pool_bytes(self, gpu: GpuInfo) -> int:
        """What the node ledger may lease of this GPU: its memory less the reserve."""
        return int(gpu.memory_bytes * (1.0 - self.device_reserve_fraction))


@dataclass(frozen=True)
class Fleet:
    profiles: tuple[FleetProfile, ...]  # ascending min_memory_gb
    cpu_profile: FleetProfile

    def by_name(self, name: str) -> FleetProfile:
        for profile in self.profiles + (self.cpu_profile,):
            if profile.name == name:
                return profile
        raise KeyError(f"no fleet profile {name!r}; known: {[p.name for p in self.profiles]}")


def _profile(raw: dict) -> FleetProfile:
    known = set(FleetProfile.__dataclass_fields__)
    unknown = set(raw) - known
    if unknown:
        raise ValueError(f"fleet profile {raw.get('name')!r}: unknown keys {sorted(unknown)}")
    return FleetProfile(**{**raw, "match": tuple(raw.get("match", ()))})


@lru_cache(maxsize=4)
def load_fleet(path: Path = FLEET_YAML) -> Fleet:
    raw = yaml.safe_load(Path(path).read_text())
    profiles = tuple(sorted((_profile(p) for p in raw["profiles"]), key=lambda p: p.min_memory_gb))
    return Fleet(profiles, _profile(raw["cpu_profile"]))


def _words(text: str) -> str:
    return " " + " ".join(text.upper().replace("-", " ").replace("_", " ").split()) + " "


def profile_for_gpu(gpu: GpuInfo | None, fleet: Fleet | None = None) -> FleetProfile:
    """The profile for the GPU a replica sees (None: no GPU), said in one log line."""
    fleet = fleet or load_fleet()
    if gpu is None:
        logger.info("fleet profile %s: no GPU", fleet.cpu_profile.name)
        return fleet.cpu_profile
    name = _words(gpu.name)
    for profile in reversed(fleet.profiles):  # largest class first: "H100" before nothing else
        if any(_words(fragment) in name for fragment in profile.match):
            logger.info("fleet profile %s for GPU %r: name matches", profile.name, gpu.name)
            return profile
    memory_gb = gpu.memory_bytes / GB
    fitting = [p for p in fleet.profiles if memory_gb >= p.min_memory_gb * MEMORY_TOLERANCE]
    if not fitting:
        logger.info("fleet profile %s for GPU %r: %.1f GB is below every class",
                    fleet.profiles[0].name, gpu.name, memory_gb)
        return fleet.profiles[0]
    logger.info("fleet profile %s for GPU %r: by memory, %.1f GB >= %.0f GB class",
                fitting[-1].name, gpu.name, memory_gb, fitting[-1].min_memory_gb)
    return fitting[-1]
