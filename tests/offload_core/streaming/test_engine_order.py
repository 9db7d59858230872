"""Layers stream in the order they run, whatever order their groups are declared in.

The model is HunyuanVideo's shape in miniature: its token refiner runs before every transformer
block. Declared last and traced, it must stream exactly like the same model declared in order:
same resident layers, same bytes copied, no wasted prefetch, bitwise the plain output.
"""
from __future__ import annotations

import pytest
import torch

from offload_core.layout import LayoutError
from offload_core.planner.facts import LinkFacts, PipelineFacts, Stage, profile_component
from offload_core.planner.search import ComponentOverride, PerformanceMode, plan_pipeline
from offload_core.residency.lifecycle import PipelineResidency
from offload_core.streaming.engine import ResidentPlacement, StreamingConfig, apply_layer_streaming
from tests.offload_core.tiny_models import hunyuan_inputs, refiner_trace, tiny_hunyuan

DECLARED_LAST = ("transformer_blocks", "single_transformer_blocks", "context_embedder.refiner_blocks")
IN_ORDER = ("context_embedder.refiner_blocks", "transformer_blocks", "single_transformer_blocks")


def _two_requests(groups, **config):
    model = tiny_hunyuan(groups)
    inputs = hunyuan_inputs()
    with torch.no_grad():
        expected = model(**inputs)
    streamer = apply_layer_streaming(model, "cpu", StreamingConfig(**config))
    outputs, copied = [], []
    for _ in range(2):
        streamer.prepare_for_use()
        with torch.no_grad():
            outputs.append(model(**inputs))
        streamer.finish_use()
        copied.append(streamer.bytes_copied)
        streamer.reset_counters()
    figures = {
        "order": [layer.key for layer in streamer.layers],
        "resident": [layer.key for layer in streamer.layers if layer.resident],
        "copied": copied,
        "wasted": streamer.ring.out_of_order_entries,
        "peak": streamer.meter.peak_bytes,
        "predicted": streamer.predicted_peak_bytes(),
    }
    assert all(torch.equal(out, expected) for out in outputs), "streamed output must be bitwise the plain one"
    streamer.remove()
    return figures


@pytest.mark.parametrize("placement", list(ResidentPlacement))
@pytest.mark.parametrize("depth", [1, 2])
def test_a_refiner_declared_last_but_run_first_streams_like_one_declared_in_order(placement, depth):
    traced = _two_requests(DECLARED_LAST, trace=refiner_trace, resident=2, resident_placement=placement,
                           prefetch_depth=depth)
    declared = _two_requests(IN_ORDER, resident=2, resident_placement=placement, prefetch_depth=depth)
    assert traced == declared
    assert traced["wasted"] == 0, "every entry found its layer prefetched: the ring follows execution order"
    assert traced["peak"] == traced["predicted"]
    if placement is ResidentPlacement.LEADING:
        assert traced["resident"] == ["context_embedder.refiner_blocks.0", "context_embedder.refiner_blocks.1"]


def test_without_the_trace_the_declared_order_wastes_prefetches():
    # What the trace fixes: streamed in declared order, the refiner's entries miss the window.
    untraced = _two_requests(DECLARED_LAST, resident=0)
    assert untraced["wasted"] > 0
    assert untraced["copied"][0] > _two_requests(IN_ORDER, resident=0)["copied"][0]


def test_a_layer_without_parameters_gets_no_slot_and_no_hook(remove_after):
    model = tiny_hunyuan(IN_ORDER)
    gelu = model.single_transformer_blocks[1]
    streamer = remove_after(apply_layer_streaming(model, "cpu", StreamingConfig(prefetch_depth=1)))
    assert "single_transformer_blocks.1" not in [layer.key for layer in streamer.layers]
    assert len(streamer.layers) == 7 and streamer.ring.n_slots == 2
    assert not gelu._forward_pre_hooks and not gelu._forward_hooks
    streamer.remove()


def test_a_layer_order_that_misses_a_layer_is_refused_before_anything_moves(remove_after):
    model = tiny_hunyuan(IN_ORDER)
    weight = model.transformer_blocks[0].linear.weight
    with pytest.raises(LayoutError, match="missing"):
        remove_after(apply_layer_streaming(model, "cpu", StreamingConfig(layer_order=("transformer_blocks.0",))))
    assert weight.numel() > 0 and weight.device.type == "cpu"


def test_a_trace_and_a_layer_order_together_are_refused():
    with pytest.raises(ValueError, match="not both"):
        StreamingConfig(trace=refiner_trace, layer_order=("blocks.0",))


def _planned(groups, trace=None):
    """Plan and run one component the way the service does: profile (traced), plan, apply, measure."""
    model = tiny_hunyuan(groups)
    profile = profile_component("dit", model, uses_per_request=3, trace=trace)
    facts = PipelineFacts((profile,), (Stage("denoise", ("dit",)),), 1 << 30, LinkFacts(25e9, 8e9), 1 << 30)
    plan = plan_pipeline(facts, PerformanceMode.MEMORY, {"dit": ComponentOverride(resident_layers=2)})
    residency = PipelineResidency.apply({"dit": model}, plan, "cpu")
    inputs = hunyuan_inputs()
    with residency.stage(["dit"]), torch.no_grad():
        for _ in range(3):
            model(**inputs)
    figures = residency.finish_request()
    streamer = residency.components["dit"].streamer
    resident = [layer.key for layer in streamer.layers if layer.resident]
    residency.remove()
    return plan, resident, figures


def test_the_plan_and_the_engine_agree_on_the_order_a_traced_model_runs_in():
    plan, resident, figures = _planned(DECLARED_LAST, trace=refiner_trace)
    plan_in_order, resident_in_order, figures_in_order = _planned(IN_ORDER)
    assert [k for k, _ in plan.component("dit").hosting] == [k for k, _ in plan_in_order.component("dit").hosting]
    assert resident == resident_in_order == ["context_embedder.refiner_blocks.0", "context_embedder.refiner_blocks.1"]
    assert figures == figures_in_order
    assert figures.bytes_moved == plan.bytes_moved_per_request
    assert figures.peak_device_bytes == plan.peak_device_bytes
