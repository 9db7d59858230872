"""A stage replica plans from its warm-up: measured compute per layer, predicted activations as its working set."""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from deployments.app import StageArgs, stage_configs
from deployments.models import families
from deployments.replica import worker as worker_module
from deployments.replica.stage_residency import predicted_kept_bytes
from deployments.replica.warmup import WarmupShape
from deployments.wire.spec import GenerationSpec, PipelineStage
from offload_core.planner.activation_model import ACTIVATION_MARGIN
from offload_core.planner.facts import profile_component
from offload_core.planner.search import PerformanceMode
from offload_core.planner.strategy import Strategy
from offload_core.planner.timeline import Lane
from tests.deployments.conftest import tiny_args
from zoo import tiny

CPU = torch.device("cpu")
SHARE = 1_200_000
SPEC = GenerationSpec("r", "a fox", None, 16, 16, 5, 2, 5.0, 3, 1)


@pytest.fixture(scope="module")
def facts():
    return families.read_family_traits(tiny.ensure_tiny_wan())


@pytest.mark.parametrize("stage", list(PipelineStage), ids=lambda s: s.value)
def test_the_final_plan_carries_measured_compute_and_the_default_requests_activations_as_working_set(
        facts, workers, stage):
    args = tiny_args()
    worker = workers(stage_configs(args, facts)[stage])
    plan = worker.residency.plan
    shape = WarmupShape.default_for(args.limits, facts)
    assert shape == WarmupShape(16, 16, 5) and worker.warmup.shape == shape
    batch = args.batching.max_batch if stage is PipelineStage.DENOISE else 1
    predicted = worker.activations.predict(shape.spec(facts, n=batch))
    assert worker.warmup.batch == batch and worker.warmup.predicted_activation_bytes == predicted > 0
    assert plan.facts.working_set_bytes == math.ceil(ACTIVATION_MARGIN * predicted)
    assert plan.weight_budget == plan.device_capacity - plan.facts.working_set_bytes
    plain = families.stage_modules(families.load_stage_pipeline(facts, stage, torch.float32), facts, stage)
    for profile in plan.facts.components:
        assert profile.layers and all(s > 0 for s in profile.compute_s_per_layer), profile.name
        # Planned from the model's own bytes, not from the placeholders its streamed layers hold now.
        expected = profile_component(profile.name, plain[profile.name], uses_per_request=1)
        assert [layer.nbytes for layer in profile.layers] == [layer.nbytes for layer in expected.layers]
        assert profile.non_layer_bytes == expected.non_layer_bytes
    assert plan.compute_s_per_request > 0
    explained = "\n".join(worker.report().plan)
    assert f"{plan.facts.working_set_bytes / 2**30:.2f} GiB kept for activations" in explained
    assert "planned from a warm-up at 16x16x5 (1 step): compute per use" in explained
    assert f"working set {plan.facts.working_set_bytes} B" in explained


def test_a_replan_that_changes_the_plan_stays_bitwise_and_leases_exactly_what_it_keeps(facts, workers, monkeypatch):
    # A share that holds the whole tiny transformer resident (170 KB) while nothing is kept for
    # activations, but not beside the activations of four 16x16x5 requests (~3.7 MB with the margin; one
    # leases ~0.8 MB, guidance's two branches in one forward):
    # planned at first with 0 s and no working set the transformer is resident; from the warm-up it streams.
    opened = worker_module.open_replica_memory

    def small_share(owner, device):
        memory = opened(owner, device)
        memory.share_bytes = SHARE
        return memory

    monkeypatch.setattr(worker_module, "open_replica_memory", small_share)
    args = tiny_args(denoiser=StageArgs(offload_mode=PerformanceMode.AUTO, host_memory_budget="64MiB"))
    worker = workers(stage_configs(args, facts)[PipelineStage.DENOISE])
    assert "transformer: strategy resident -> layerwise" in worker.warmup.changes
    plan = worker.residency.plan
    assert plan.component("transformer").strategy is Strategy.LAYERWISE and plan.feasible
    assert plan.facts.working_set_bytes == SHARE - worker.residency.predicted_peak_bytes(), \
        "the working set was capped where the leanest plan's weights begin"

    # As the warm-up left it, before any call could resize the lease.
    kept = worker.residency.kept_bytes()
    assert kept == predicted_kept_bytes(plan) == worker.leases.figures().standing_bytes
    standing = [lease for lease in worker.memory.device_budget.outstanding(worker.replica)
                if lease.purpose.startswith("standing")]
    assert [lease.nbytes for lease in standing] == [kept], "one standing lease, of the bytes kept"
    # Between calls: the non-layer weights (and buffers, which no plan counts) on the device, every
    # layer once on the host (its flat layout, in the node store), nothing left from the resident plan.
    weights = worker.residency.report().component("transformer")
    buffers = sum(b.numel() * b.element_size() for b in worker.pipe.transformer.buffers())
    assert weights.device_bytes == kept + buffers
    assert weights.host_bytes == plan.facts.component("transformer").layer_bytes

    encoder = families.load_stage_pipeline(facts, PipelineStage.ENCODE, torch.float32)
    encoded = families.encode(encoder, facts, SPEC, CPU)
    out = worker.run(lambda: families.denoise(worker.pipe, facts, encoded, SPEC, worker.device), SPEC)
    plain_pipe = families.load_stage_pipeline(facts, PipelineStage.DENOISE, torch.float32)
    plain = families.denoise(plain_pipe, facts, encoded, SPEC, CPU)
    assert torch.equal(out.value, plain), "the re-applied plan changed the latents"
    assert out.stats.device_peak_bytes == worker.residency.predicted_peak_bytes()
    assert worker.leases.figures().standing_bytes == kept, "a call leaves the standing lease as the replan set it"


def test_a_replan_that_keeps_the_plan_keeps_the_applied_residency_and_shows_the_new_predictions(facts, workers):
    args = tiny_args()  # the denoiser in memory mode: nothing the measurements could change
    worker = workers(stage_configs(args, facts)[PipelineStage.DENOISE])
    assert worker.warmup.changes == ()
    plan = worker.residency.plan
    assert plan.component("transformer").strategy is Strategy.LAYERWISE
    assert plan.compute_s_per_request > 0 and plan.facts.working_set_bytes > 0
    assert worker.leases.figures().standing_bytes == worker.residency.kept_bytes()
    # The picture's measured pass is the warm-up's last pass as it ran: its copies beside its compute.
    transformer = next(c for c in worker.report().picture.components if c.name == "transformer")
    streamed = [key for key, _ in plan.component("transformer").hosting][plan.component("transformer").resident_layers:]
    copied = [s.layer for s in transformer.measured.lane(Lane.COPY)]
    assert copied == streamed and all(s.end_s > s.start_s for s in transformer.measured.lane(Lane.COPY))
    # Re-predicted, the same decisions predict the same bytes: the ring's slots are still in the peak.
    encoded = families.encode(families.load_stage_pipeline(facts, PipelineStage.ENCODE, torch.float32), facts,
                              SPEC, CPU)
    out = worker.run(lambda: families.denoise(worker.pipe, facts, encoded, SPEC, worker.device), SPEC)
    assert out.stats.device_peak_bytes == worker.residency.predicted_peak_bytes() > worker.residency.kept_bytes()


def test_a_default_size_the_api_would_refuse_fails_the_build(facts):
    from deployments.capacity.request_limits import FieldError, Limits

    with pytest.raises(FieldError, match="multiples of 16"):
        WarmupShape.default_for(Limits(default_size="20x20"), facts)
    assert WarmupShape.default_for(Limits(default_size="32x16", default_frames=9), facts) == WarmupShape(32, 16, 9)
    flux = families.read_family_traits(tiny.ensure_tiny_flux())
    assert dataclasses.astuple(WarmupShape.default_for(Limits(), flux)) == (256, 256, 1), "images only: one frame"
