"""A stage replica's start, one step a function, in the order :class:`~deployments.replica.worker.StageWorker` runs them.

1. :func:`load_pipeline`: the stage's components from the folder (a tensor-parallel rank: its slice);
2. :func:`host_budget_bytes`: the stage's ``host_memory_budget`` on this node;
3. :func:`provisional_plan`: planned before anything ran (0 s of compute, no working set), against the
   replica's share of its GPU; the worker then leases what the plan keeps on the device;
4. :func:`shared_weights`: the node weight store the streamed layers are hosted from, if any;
5. :func:`residency_applier`: what applies a plan (the provisional one now, the warm-up's later).

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
from deployments.models import families
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
    return families.load_stage_pipeline(config.facts, config.stage, dtype, loaded)


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


__all__ = ["host_budget_bytes", "load_pipeline", "provisional_plan", "residency_applier", "shared_weights"]
