"""A stage replica's start, step by step (deployments/replica/worker_setup.py), each on the tiny Wan."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from deployments.app import stage_configs
from deployments.models import families
from deployments.replica import worker_setup as setup
from deployments.replica.leases import open_replica_memory
from deployments.replica.rank_spec import RankSpec
from deployments.wire.spec import PipelineStage
from offload_core.planner.strategy import Strategy
from tests.deployments.conftest import tiny_args
from zoo import tiny

CPU = torch.device("cpu")
ENCODE, DENOISE = PipelineStage.ENCODE, PipelineStage.DENOISE


@pytest.fixture(scope="module")
def configs():
    return stage_configs(tiny_args(), families.read_family_traits(tiny.ensure_tiny_wan()))


@pytest.fixture
def memory():
    opened = open_replica_memory("setup-test", CPU)
    yield opened
    opened.close()


def test_load_pipeline_loads_only_the_stages_components(configs):
    pipe = setup.load_pipeline(configs[ENCODE])
    assert pipe.text_encoder is not None and pipe.transformer is None and pipe.vae is None


def test_host_budget_bytes_resolves_the_stages_budget_on_this_node(configs, memory):
    assert setup.host_budget_bytes(configs[DENOISE], memory, "r") == 64 * 2**20  # tiny_args: "64MiB"
    assert setup.host_budget_bytes(configs[ENCODE], memory, "r") is None  # unset


def test_the_provisional_plan_has_no_compute_and_no_working_set_within_the_replicas_share(configs, memory):
    config = configs[DENOISE]
    pipe = setup.load_pipeline(config)
    plan = setup.provisional_plan(config, families.stage_modules(pipe, config.facts, DENOISE), CPU, memory,
                                  64 * 2**20)
    assert plan.device_capacity == memory.share_bytes and plan.facts.working_set_bytes == 0
    assert plan.compute_s_per_request == 0
    assert plan.component("transformer").strategy is Strategy.LAYERWISE  # tiny_args: the denoiser in MEMORY mode


def test_shared_weights_are_the_node_store_except_for_a_rank_or_when_switched_off(configs, memory):
    config = configs[DENOISE]
    modules = families.stage_modules(setup.load_pipeline(config), config.facts, DENOISE)
    assert setup.shared_weights(config, modules, memory, "r", None) is not None
    assert setup.shared_weights(config, modules, memory, "r", None, RankSpec(0, 2, "tp")) is None
    off = dataclasses.replace(config, share_host_weights=False)
    assert setup.shared_weights(off, modules, memory, "r", None) is None


def test_the_applier_puts_the_components_under_the_plan_it_is_given(configs, memory):
    config = configs[DENOISE]
    pipe = setup.load_pipeline(config)
    modules = families.stage_modules(pipe, config.facts, DENOISE)
    plan = setup.provisional_plan(config, modules, CPU, memory, None)
    residency = setup.residency_applier(config, modules, CPU, memory, "r", None, None)(plan=plan)
    try:
        assert [c.decisions() for c in residency.plan.components] == [c.decisions() for c in plan.components]
        assert residency.predicted_peak_bytes() == plan.peak_device_bytes
    finally:
        residency.remove()
