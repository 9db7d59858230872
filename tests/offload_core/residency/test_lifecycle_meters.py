"""The residency sampler is a total its components' meters keep: O(1) per change, equal to the walk."""
from __future__ import annotations

import pytest
import torch

from offload_core.planner.facts import PipelineFacts
from offload_core.planner.measured_compute import profiles_from_warmup
from offload_core.planner.search import PerformanceMode, plan_pipeline
from offload_core.residency.compute_meter import measure_warmup
from offload_core.residency.lifecycle import PipelineResidency
from offload_core.streaming import meter as meter_module
from tests.offload_core.residency.test_lifecycle import GROUPS, LINK, TABLES, _flux, _wan, toy_plan, toys


def test_a_request_with_parking_and_streaming_never_walks_the_parameters(cpu_capacity, monkeypatch, remove_after):
    cpu_capacity(10_000)  # tight: non-layer weights park and restore every stage
    plan = toy_plan(10_000)
    models = toys()
    res = remove_after(PipelineResidency.apply(models, plan, "cpu"))

    def no_walks(*_args):
        raise AssertionError("a meter walked the parameters during a request")

    monkeypatch.setattr(meter_module, "walked_device_bytes", no_walks)
    for _request in range(2):
        with torch.no_grad():
            with res.stage(["a"]):
                y = models["a"](torch.randn(2, 16))
            with res.stage(["b"]):
                for _ in range(3):
                    models["b"](y)
        figures = res.finish_request()
        assert figures.peak_device_bytes == plan.peak_device_bytes
        assert figures.bytes_moved == plan.bytes_moved_per_request
    monkeypatch.undo()


def _audit(res: PipelineResidency, seen: list) -> None:
    """After every hook of every hooked module: each component's count equals its walk."""
    def check(*_args) -> None:
        for name, c in res.components.items():
            assert c.meter.current_bytes == c.meter.walk(), f"{name}: {c.meter.current_bytes} != {c.meter.walk()}"
        walked = sum(c.meter.walk() for c in res.components.values())
        assert res.device_bytes_now() == walked, "the residency's total disagrees with the walk"
        seen.append(walked)

    for c in res.components.values():
        for module in c.hooked_modules():
            module.register_forward_pre_hook(check)
            module.register_forward_hook(check, always_call=True)


@pytest.mark.parametrize("family", [_wan, _flux], ids=["wan", "flux"])
def test_every_component_meter_equals_the_walk_at_every_hook_in_every_mode(family, cpu_capacity, remove_after):
    comps, stages, call = family()
    groups = GROUPS if "text_encoder_2" in comps else {}
    figures = measure_warmup(comps, call, groups)
    facts = PipelineFacts(profiles_from_warmup(comps, figures, TABLES, groups), stages, 0, LINK, 1 << 30)
    memory_peak = plan_pipeline(facts, PerformanceMode.MEMORY).peak_device_bytes
    capacity = memory_peak + memory_peak // 2  # tight: the gates park, so moves are audited too
    facts = PipelineFacts(facts.components, stages, capacity, LINK, 1 << 30)
    cpu_capacity(capacity)
    for mode in PerformanceMode:
        plan = plan_pipeline(facts, mode)
        comps, _, call = family()
        res = remove_after(PipelineResidency.apply(comps, plan, "cpu", tables=TABLES))
        seen: list[int] = []
        _audit(res, seen)
        for _request in range(2):
            with res.following_calls(), torch.no_grad():
                call()
            measured = res.finish_request()
            for name, c in res.components.items():
                assert c.meter.current_bytes == c.meter.walk(), (mode.value, name)
            assert measured.peak_device_bytes == max(seen), "the sampler's peak is what the hooks saw"
        assert seen and max(seen) <= plan.peak_device_bytes, mode.value
        res.remove()
