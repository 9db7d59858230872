"""Execution order, settled before any plan: traced on meta tensors, or given and validated."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from offload_core.layout import LayoutError, declared_layer_groups
from offload_core.order import declared_layers, execution_order, on_meta, traced_order
from tests.offload_core.tiny_models import ALL_CASES, refiner_trace, tiny_hunyuan

DECLARED_LAST = ("transformer_blocks", "single_transformer_blocks", "context_embedder.refiner_blocks")
IN_ORDER = ("context_embedder.refiner_blocks", "transformer_blocks", "single_transformer_blocks")


def test_a_traced_forward_puts_the_refiner_that_runs_first_first():
    model = tiny_hunyuan(DECLARED_LAST)
    ordered = execution_order(model, DECLARED_LAST, trace=refiner_trace)
    assert [layer.key for layer in ordered] == [layer.key for layer in declared_layers(model, IN_ORDER)]
    assert ordered[0].key == "context_embedder.refiner_blocks.0"


def test_layers_without_parameters_are_not_layers_to_stream():
    model = tiny_hunyuan(IN_ORDER)
    keys = [layer.key for layer in declared_layers(model, IN_ORDER)]
    # single_transformer_blocks.1 is a GELU kept in the ModuleList: nothing to copy, so no slot.
    assert "single_transformer_blocks.1" not in keys
    assert "single_transformer_blocks.0" in keys and "single_transformer_blocks.2" in keys


def test_the_trace_runs_on_meta_tensors_and_puts_every_tensor_back():
    model = tiny_hunyuan(DECLARED_LAST)
    before = {name: (t.data_ptr(), t.device) for name, t in model.state_dict(keep_vars=True).items()}
    params = list(model.parameters())
    devices = []
    traced_order(model, declared_layers(model, DECLARED_LAST),
                 lambda m: devices.append({p.device.type for p in m.parameters()}) or refiner_trace(m))
    assert devices == [{"meta"}], "the traced forward must compute on meta tensors, never the weights"
    assert {name: (t.data_ptr(), t.device) for name, t in model.state_dict(keep_vars=True).items()} == before
    assert [id(p) for p in model.parameters()] == [id(p) for p in params], "parameters are the same objects"


def test_tensors_are_put_back_when_the_trace_raises():
    model = tiny_hunyuan(DECLARED_LAST)
    weight = model.transformer_blocks[0].linear.weight

    def broken(m):
        raise RuntimeError("bad trace")

    with pytest.raises(RuntimeError, match="bad trace"):
        with on_meta(model):
            broken(model)
    assert model.transformer_blocks[0].linear.weight is weight and weight.device.type == "cpu"


def test_a_trace_that_skips_a_layer_is_refused_with_its_key():
    model = tiny_hunyuan(DECLARED_LAST)

    def refiner_only(m):
        ctx = torch.empty(1, 3, 8, device="meta")
        for block in m.context_embedder.refiner_blocks:
            ctx = block(ctx)

    with pytest.raises(LayoutError, match=r"never entered 5 .*transformer_blocks.0"):
        execution_order(model, DECLARED_LAST, trace=refiner_only)


def test_a_given_layer_order_must_name_every_layer_once():
    model = tiny_hunyuan(IN_ORDER)
    keys = [layer.key for layer in declared_layers(model, IN_ORDER)]
    assert [layer.key for layer in execution_order(model, IN_ORDER, layer_order=keys[::-1])] == keys[::-1]
    with pytest.raises(LayoutError, match="missing"):
        execution_order(model, IN_ORDER, layer_order=keys[1:])
    with pytest.raises(LayoutError, match="unknown"):
        execution_order(model, IN_ORDER, layer_order=[*keys, "transformer_blocks.9"])
    with pytest.raises(ValueError, match="not both"):
        execution_order(model, IN_ORDER, layer_order=keys, trace=refiner_trace)


@pytest.mark.parametrize("case", ALL_CASES, ids=lambda c: c.name)
def test_every_known_class_declares_its_groups_in_execution_order(case):
    # KNOWN_LAYER_GROUPS is a declaration the engine trusts without a trace: this traces each class.
    model = case.build()
    groups = declared_layer_groups(model)
    inputs = {k: v.to("meta") for k, v in case.inputs().items()}
    traced = traced_order(model, declared_layers(model, groups), lambda m: case.run(m, inputs))
    assert traced == tuple(layer.key for layer in declared_layers(model, groups))


def test_a_module_list_of_only_parameterless_layers_streams_nothing():
    model = nn.Module()
    model.acts = nn.ModuleList([nn.ReLU(), nn.GELU()])
    assert declared_layers(model, ("acts",)) == ()
