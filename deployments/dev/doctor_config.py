"""What a Serve config asks of the machine it runs on, for ``offload-serve doctor`` (the user's shell).

Read from the YAML alone: the stages' GPUs and replica counts (the Serve options of each stage
deployment), their per-replica host budgets and the model each application serves (its ``args``, as
``deployments.app.AppArgs`` reads them). Neither Ray nor the app's pydantic models are imported,
so the doctor answers in a fraction of a second; ``offload-serve serve`` still validates the whole
config strictly when it deploys it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import yaml

from offload_core.host.budget_cap import HostBudgetSpec, parse_host_budget

# The stage deployments deployments.app binds, and the AppArgs key of each one's stage options.
STAGE_ARGS = {"TextEncoder": "encoder", "Denoiser": "denoiser", "VaeDecoder": "decoder"}


class ConfigError(ValueError):
    """The config cannot be read for what it needs (the message names the file and the key)."""


@dataclass(frozen=True)
class StageNeeds:
    application: str
    deployment: str  # TextEncoder | Denoiser | VaeDecoder
    gpus_per_replica: float  # ray_actor_options.num_gpus, or tp_size whole GPUs for a tensor-parallel stage
    min_replicas: int  # what the application needs to start
    max_replicas: int  # what it may scale to on this machine
    host_budget: HostBudgetSpec | None  # args.<stage>.host_memory_budget


@dataclass(frozen=True)
class ModelNeeds:
    application: str
    model_path: str | None  # None: the tiny zoo's model of tiny_family
    tiny_family: str


@dataclass(frozen=True)
class ConfigNeeds:
    path: Path
    stages: tuple[StageNeeds, ...]
    models: tuple[ModelNeeds, ...]
    object_store_bytes: int  # the object store the Ray head will have

    def gpus_needed(self) -> int:
        """Whole GPUs the stages' minimum replicas take (0.2 + 0.6 + 0.2 of one GPU is one)."""
        total = sum(s.gpus_per_replica * s.min_replicas for s in self.stages)
        return math.ceil(round(total, 6))

    def describe_gpu_stages(self) -> str:
        return ", ".join(f"{s.deployment} {s.min_replicas} x {s.gpus_per_replica:g}"
                         for s in self.stages if s.gpus_per_replica > 0)


def _replicas(options: dict) -> tuple[int, int]:
    scaling = options.get("autoscaling_config") or {}
    count = options.get("num_replicas")
    if isinstance(count, int):
        return count, count
    return int(scaling.get("min_replicas", 1)), int(scaling.get("max_replicas", scaling.get("min_replicas", 1)))


def _stage(path: Path, app: str, options: dict, stage_args: dict) -> StageNeeds:
    deployment = options.get("name", "?")
    actor = options.get("ray_actor_options") or {}
    gpus = float(actor.get("num_gpus") or 0)
    if int(stage_args.get("tp_size", 1)) > 1 and stage_args.get("tp_device", "auto") == "gpu":
        gpus = float(stage_args["tp_size"])  # one whole GPU per rank, in one placement group
    budget = stage_args.get("host_memory_budget")
    try:
        spec = None if budget is None else parse_host_budget(budget)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{path}: {app}: {STAGE_ARGS[deployment]}.host_memory_budget: {exc}") from None
    low, high = _replicas(options)
    return StageNeeds(app, deployment, gpus, low, max(low, high), spec)


def read_config(path: Path, object_store_bytes: int) -> ConfigNeeds:
    """The needs of every application in a Serve config file (``serve run``'s format)."""
    try:
        raw = yaml.safe_load(Path(path).read_text())
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path} is not YAML: {exc}") from None
    if not isinstance(raw, dict) or not isinstance(raw.get("applications"), list) or not raw["applications"]:
        raise ConfigError(f"{path}: not a Serve config (no `applications:` list)")
    stages, models = [], []
    for app in raw["applications"]:
        name, args = app.get("name", "?"), app.get("args") or {}
        if not isinstance(args, dict):
            raise ConfigError(f"{path}: {name}: args must be a mapping, got {type(args).__name__}")
        by_name = {d.get("name"): d for d in app.get("deployments") or []}
        for deployment, key in STAGE_ARGS.items():
            # A stage the file does not list runs with build_app's defaults: one replica, no GPU.
            stages.append(_stage(Path(path), name, by_name.get(deployment, {"name": deployment}), args.get(key) or {}))
        models.append(ModelNeeds(name, args.get("model_path"), args.get("tiny_family", "wan")))
    return ConfigNeeds(Path(path), tuple(stages), tuple(models), object_store_bytes)
