"""Following a pipeline's own calls: the stage switch happens at the first call into another
stage's component, and a component in use carries no following hooks (they would only cost)."""
from __future__ import annotations

import torch

from offload_core.residency.lifecycle import PipelineResidency, UseState
from tests.offload_core.residency.test_lifecycle import toy_plan, toys


def _hooked(module) -> int:
    return sum(len(m._forward_pre_hooks) for m in module.modules())


def test_only_components_out_of_use_carry_the_following_hooks(cpu_capacity, remove_after):
    cpu_capacity(10_000_000)
    x = torch.randn(1, 16)
    with torch.no_grad():
        reference = {name: model(x) for name, model in toys().items()}
    models = toys()
    res = remove_after(PipelineResidency.apply(models, toy_plan(10_000_000), "cpu"))
    engine_hooks = {name: _hooked(model) for name, model in models.items()}  # the streamers' own
    for _ in range(2):  # two requests: hooks put back by the first are not doubled by the second
        with torch.no_grad(), res.following_calls():
            assert all(_hooked(m) > engine_hooks[n] for n, m in models.items()), "every component out: hooked"
            assert torch.equal(models["a"](x), reference["a"])
            assert res.components["a"].state is UseState.IN_USE
            assert _hooked(models["a"]) == engine_hooks["a"], "a component in use keeps no following hook"
            assert torch.equal(models["b"](x), reference["b"])  # the switch: a finished, b prepared
            assert res.components["a"].state is UseState.OUT and res.components["b"].state is UseState.IN_USE
            assert _hooked(models["a"]) > engine_hooks["a"] and _hooked(models["b"]) == engine_hooks["b"]
            assert torch.equal(models["a"](x), reference["a"])  # back to a: followed again
            assert res.components["a"].state is UseState.IN_USE and res.components["b"].state is UseState.OUT
        assert {n: _hooked(m) for n, m in models.items()} == engine_hooks, "no following hook outlives the block"
        res.finish_use([n for n in models if res.in_use(n)])
        res.finish_request()
