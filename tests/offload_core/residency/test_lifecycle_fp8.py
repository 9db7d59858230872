"""FP8 stages through the plan: the cost model, the host lease and the report count the 8-bit bytes the engine moves."""
from __future__ import annotations

import pytest
import torch

from offload_core.host.budget import InProcessLedger
from offload_core.host.tier import HostingTier
from offload_core.planner.facts import LinkFacts, PipelineFacts, Stage, profile_component
from offload_core.planner.search import PerformanceMode, plan_pipeline
from offload_core.quant import WeightFormat, fake_quantize_
from offload_core.residency.lifecycle import PipelineResidency
from tests.offload_core.residency.test_lifecycle import Toy, mapped_toys

LINK = LinkFacts(pinned_Bps=25e9, pageable_Bps=8e9)
STAGES = (Stage("first", ("a",)), Stage("second", ("b",)))
USES = {"a": 1, "b": 3}


def _plan(weights: WeightFormat, lease: int, width: int = 32):
    profiles = tuple(profile_component(name, Toy(i, width), uses_per_request=USES[name], weights=weights)
                     for i, name in enumerate("ab"))
    return plan_pipeline(PipelineFacts(profiles, STAGES, 1 << 20, LINK, host_lease_bytes=lease),
                         PerformanceMode.MEMORY)


def _run(res, x):
    outs = {}
    with torch.no_grad():
        for name in "ab":
            with res.stage([name]):
                for _ in range(USES[name]):
                    outs[name] = res.components[name].module(x)
    return outs


@pytest.mark.parametrize("lease", [1 << 30, 0], ids=["pinned", "pageable"])
def test_an_fp8_plan_predicts_the_8bit_bytes_its_requests_move_and_stays_bitwise(lease, cpu_capacity, remove_after):
    cpu_capacity(1 << 20)
    native, fp8 = _plan(WeightFormat.NATIVE, lease), _plan(WeightFormat.FP8, lease)
    assert all(c.weights is WeightFormat.FP8 for c in fp8.components)
    assert fp8.bytes_moved_per_request < native.bytes_moved_per_request
    res = remove_after(PipelineResidency.apply({"a": Toy(0, 32), "b": Toy(1, 32)}, fp8, "cpu"))
    tier = HostingTier.PINNED if lease else HostingTier.PAGEABLE
    assert all(layer.tier is tier for c in res.components.values() for layer in c.streamer.layers)
    reference = {"a": Toy(0, 32), "b": Toy(1, 32)}
    for model in reference.values():
        fake_quantize_(model.blocks)
    x = torch.randn(2, 32, generator=torch.Generator().manual_seed(2))
    for _ in range(2):  # the first request and the steady state
        outs = _run(res, x)
        figures = res.finish_request()
        assert figures.bytes_moved == res.plan.bytes_moved_per_request
        assert figures.peak_device_bytes == res.plan.peak_device_bytes
    with torch.no_grad():
        assert all(torch.equal(outs[n], reference[n](x)) for n in "ab")
    for name, c in res.components.items():
        assert res.plan.component(name).prediction.in_use_bytes == c.streamer.meter.peak_bytes
        assert res.plan.component(name).prediction.staging_bytes == c.streamer.staging_bytes
    report = res.report().component("b")
    assert report.weights == "fp8" and report.layer_host_bytes < report.layer_native_bytes
    assert "fp8 weights: layers host" in res.plan.component("b").explain()


def test_the_host_lease_counts_the_8bit_buffers(cpu_capacity, tmp_path, remove_after):
    cpu_capacity(1 << 20)
    leases = {}
    for weights in WeightFormat:
        ledger = InProcessLedger(10**7)
        # Layers left on the checkpoint's mapping: hosting them costs their whole host buffers.
        (tmp_path / weights.value).mkdir()
        res = remove_after(PipelineResidency.apply(mapped_toys(tmp_path / weights.value), _plan(weights, 1 << 30, 16),
                                                   "cpu", ledger, owner="toy"))
        hosted = sum(layer.host.nbytes for c in res.components.values() for layer in c.streamer.layers)
        leases[weights] = (ledger.leased(), hosted)
        res.remove()
    assert leases[WeightFormat.NATIVE][0] == leases[WeightFormat.NATIVE][1]
    assert leases[WeightFormat.FP8][0] == leases[WeightFormat.FP8][1] < leases[WeightFormat.NATIVE][1]
