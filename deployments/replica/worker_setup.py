"""A stage replica's start, one step a function, in the order :class:`~deployments.replica.worker.StageWorker` runs them.

1. :func:`load_pipeline`: the stage's components from the folder (a tensor-parallel rank: its slice);
2. :func:`host_budget_bytes`: the stage's ``host_memory_budget`` on this node;
3. :func:`provisional_plan`: planned before anything ran (0 s of compute, no working set), against the
   replica's share of its GPU; the worker then leases what the plan keeps on the device;
4. :func:`shared_weights`: the node weight store the streamed layers are hosted from, if any;
5. :func:`residency_applier`: what applies a plan (the provisional one now, the warm-up's later);
6. :func:`read_loras` (before planning: an adapter that does not fit fails the start before any lease)
   and :func:`lora_set`: the Denoiser's LoRA adapters, checked against its transformer, then on the device.

Each step takes what the ones before produced and returns a value, so each can be run and checked
alone (tests/deployments/replica/test_worker_setup.py). Run by the stage replica (and each rank actor).
"""
from __future__ import annotations

import functools
import logging
import pathlib
from typing import Callable, Mapping

import torch
from torch import nn

from cluster.replica.ledger_view import ReplicaMemory
from cluster.replica.plan import host_lease_bytes, plan_stage
from deployments.models import families, vae_tiling
from deployments.models.tensor_parallel import rank_components
from deployments.replica.rank_spec import RankSpec
from deployments.replica.stage_config import DTYPES, StageConfig
from deployments.replica.stage_residency import StageResidency
from offload_core.planner.search import PipelinePlan
from offload_core.shared_store.hosting import SharedWeights
from offload_core.shared_store.store import folder_identity

logger = logging.getLogger(__name__)


def load_pipeline(config: StageConfig, rank: RankSpec | None = None):
    """The family's pipeline with only this stage's components (a rank of a group: its slices of them)."""
    dtype = DTYPES[config.dtype]
    loaded = None
    if rank is not None and rank.size > 1:
        loaded = rank_components(config.facts, config.stage, dtype, rank.size, rank.rank)
    pipe = families.load_stage_pipeline(config.facts, config.stage, dtype, loaded)
    if config.vae_tiling:
        side = vae_tiling.enable(pipe.vae, config.vae_tile_px)
        logger.info("%s: the VAE decodes outputs wider or taller than %d px tile by tile (vae_tiling, %s tile): "
                    "its working set is about one tile's; smaller outputs decode untiled", config.stage.value, side,
                    "the VAE's own" if config.vae_tile_px is None else "the configured")
    return pipe


def host_budget_bytes(config: StageConfig, memory: ReplicaMemory, replica: str) -> int | None:
    """The stage's per-replica ``host_memory_budget`` resolved on this node (None: unset)."""
    if config.host_budget is None:
        return None
    budget = config.host_budget.resolve(memory.node.ram.spendable)
    logger.info("%s: host_memory_budget %s = %d B on this node (%d B spendable)", replica,
                config.host_budget.describe(), budget, memory.node.ram.spendable)
    return budget


def provisional_plan(config: StageConfig, modules: Mapping[str, nn.Module], device: torch.device,
                     memory: ReplicaMemory, budget: int | None) -> PipelinePlan:
    """The plan before anything ran: against the replica's share of its GPU, not the whole card; 0 s of
    compute and no working set until the warm-up measured them (deployments/replica/warmup.py)."""
    return plan_stage(config.stage.value, modules, dict(config.uses_per_request), config.mode, device,
                      memory.share_bytes, host_lease_bytes(memory.host_budget, budget), memory,
                      expected_batch=config.batching.max_batch if config.batching is not None else 1,
                      phases=families.stage_phases(config.facts, config.stage),  # Wan2.2 A14B: an expert at a time
                      weights=config.weights, tables=config.host_tables)


def shared_weights(config: StageConfig, modules: Mapping[str, nn.Module], memory: ReplicaMemory, replica: str,
                   budget: int | None, rank: RankSpec | None = None) -> SharedWeights | None:
    """The node weight store the stage's streamed layers are hosted from (one copy per node), or None.

    A rank's streamed layers differ from an unsharded replica's of the same folder (its sharded
    parameters stay out of them): never hosted from the folder's node store."""
    if not config.share_host_weights or rank is not None:
        return None
    identities = {name: folder_identity(pathlib.Path(config.facts.folder) / name) for name in modules}
    return SharedWeights(memory.store_registry(), identities, replica, budget_bytes=budget)


def residency_applier(config: StageConfig, modules: Mapping[str, nn.Module], device: torch.device,
                      memory: ReplicaMemory, replica: str, budget: int | None,
                      shared: SharedWeights | None) -> Callable[..., StageResidency]:
    """``applier(plan=...)`` puts the stage's components under ``plan`` (the worker calls it for the
    provisional plan, and again when the warm-up or a first use changes a decision)."""
    return functools.partial(
        StageResidency, config.stage.value, modules, dict(config.uses_per_request), config.mode, device,
        device_capacity=memory.share_bytes, host_budget=memory.host_budget, owner=replica, host_budget_bytes=budget,
        shared=shared, memory=memory, phases=families.stage_phases(config.facts, config.stage),
        tables=config.host_tables)


def read_loras(config: StageConfig, pipe, replica: str) -> tuple:
    """The configured adapters read into host memory (``offload_core.lora.LoraAdapter``) and checked
    against the transformer: one whose modules or shapes do not match fails the replica's start,
    naming the adapter and the module, instead of a shape error at some request's step."""
    if not config.loras:
        return ()
    from offload_core.lora import LoraError, check_fits, load_lora

    adapters = []
    for served in config.loras:
        try:
            adapter = load_lora(served.path, served.name, served.scale)
            check_fits(adapter, pipe.transformer)
        except LoraError as exc:
            raise LoraError(f"{replica}: LoRA adapter {served.name!r} from {served.path} does not fit the "
                            f"{config.facts.family.value} transformer of {config.facts.folder}: {exc}") from exc
        logger.info("%s: LoRA adapter %r: rank %d, %d Linear layers, %d B (scale %g)", replica, adapter.name,
                    adapter.rank, len(adapter.weights), adapter.nbytes, adapter.scale)
        adapters.append(adapter)
    return tuple(adapters)


def lora_device_bytes(adapters: tuple, dtype: torch.dtype) -> dict[str, int]:
    """Each adapter's device bytes: A and B in the transformer's ``dtype``, as ``LoraSet.load`` copies
    them. The standing lease covers them all, at most their budget: adapters loaded again on demand
    never outgrow it."""
    size = torch.empty((), dtype=dtype).element_size()
    return {adapter.name: sum((a.numel() + b.numel()) * size for a, b in adapter.weights.values())
            for adapter in adapters}


def lora_set(config: StageConfig, pipe, device: torch.device, adapters: tuple, replica: str):
    """The transformer's ``offload_core.lora.LoraSet`` with the adapters loaded, least recently
    loaded evicted beyond the budget (None without adapters)."""
    if not adapters:
        return None
    from offload_core.lora import apply_lora

    loras = apply_lora(pipe.transformer, device, config.lora_device_budget)
    for adapter in adapters:
        loras.load(adapter)
    loaded = loras.loaded()
    logger.info("%s: %d of %d LoRA adapters on %s (%d B of a %d B budget): %s", replica, len(loaded),
                len(adapters), device, sum(a.nbytes for a in loaded), config.lora_device_budget,
                ", ".join(a.name for a in loaded))
    return loras


__all__ = ["host_budget_bytes", "load_pipeline", "lora_device_bytes", "lora_set", "provisional_plan",
           "read_loras", "residency_applier", "shared_weights"]
