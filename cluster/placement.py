"""Placing stage deployments on GPU types: config -> Ray actor options.

A stage names the GPU type it wants either as Ray's accelerator type ("L4", "H100") or as a
fleet profile ("l4-a10g-24gb"); the helper turns it into ``ray_actor_options`` with Ray's own
``accelerator_type`` option (Ray adds the resource ``accelerator_type:<TYPE>``: 0.001, which every
node of that type advertises: KubeRay worker groups through rayStartParams, tests through a
Cluster node's custom resources). The same dict goes into a Serve deployment or an actor.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

import yaml

from cluster.fleet import Fleet, load_fleet

STAGES_YAML = Path(__file__).resolve().parents[1] / "configs" / "fleet" / "stages.yaml"


@dataclass(frozen=True)
class StagePlacement:
    stage: str
    accelerator_type: str | None  # None: anywhere (CPU stage or any GPU)
    num_gpus: float  # a fraction shares one GPU between stages; the node ledger keeps them honest
    num_cpus: float

    def __post_init__(self):
        if self.num_gpus < 0 or self.num_cpus < 0:
            raise ValueError(f"stage {self.stage}: num_gpus {self.num_gpus} and num_cpus {self.num_cpus} must be >= 0")
        if self.accelerator_type is not None and self.num_gpus == 0:
            raise ValueError(f"stage {self.stage} asks for GPU type {self.accelerator_type} but num_gpus=0: Ray "
                             "would place it on that node type without giving it a GPU")


def resolve_gpu_type(gpu_type: str, fleet: Fleet | None = None) -> str:
    """A fleet profile name or a Ray accelerator type -> the Ray accelerator type."""
    fleet = fleet or load_fleet()
    for profile in fleet.profiles:
        if profile.name == gpu_type:
            return profile.accelerator_type
    return gpu_type


def stage_placement(stage: str, raw: Mapping, fleet: Fleet | None = None) -> StagePlacement:
    unknown = set(raw) - {"gpu_type", "num_gpus", "num_cpus"}
    if unknown:
        raise ValueError(f"stage {stage}: unknown placement keys {sorted(unknown)}")
    gpu_type = raw.get("gpu_type")
    return StagePlacement(stage, resolve_gpu_type(gpu_type, fleet) if gpu_type else None,
                          float(raw.get("num_gpus", 1.0 if gpu_type else 0.0)), float(raw.get("num_cpus", 0.0)))


def load_stage_placements(path: Path = STAGES_YAML) -> dict[str, StagePlacement]:
    raw = yaml.safe_load(Path(path).read_text())["stages"]
    return {stage: stage_placement(stage, spec) for stage, spec in raw.items()}


def actor_options(placement: StagePlacement) -> dict:
    """``ray_actor_options`` for a Serve deployment (or ``.options()`` for an actor)."""
    options = {"num_cpus": placement.num_cpus, "num_gpus": placement.num_gpus}
    if placement.accelerator_type is not None:
        options["accelerator_type"] = placement.accelerator_type
    return options
