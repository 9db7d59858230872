"""The simulated accelerator: CUDA's copy, kernel and event rules on a virtual clock, data computed for real."""
from __future__ import annotations

import pytest
import torch

from offload_core.host.tier import HostingTier
from offload_core.streaming.engine import StreamingConfig, apply_layer_streaming
from testing.sim import SimDevice, SimLink, SimStream, StreamHazardError
from tests.offload_core.tiny_models import FLUX, WAN

MB = 10**6
LINK = SimLink(pinned_Bps=25e9, pageable_Bps=10e9, mapped_Bps=10e9, host_memcpy_Bps=12e9)


def _copy(sim: SimDevice, nbytes: int, tier: HostingTier) -> tuple[torch.Tensor, torch.Tensor]:
    src, dst = torch.ones(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
    sim.register_host_memory([src], tier)
    with sim.on_copy_stream():
        dst.copy_(src, non_blocking=True)
    return src, dst


def test_a_pinned_copy_returns_at_once_and_a_pageable_one_blocks_the_host_until_it_lands():
    sim = SimDevice(LINK)
    _, dst = _copy(sim, 25 * MB, HostingTier.PINNED)
    assert torch.equal(dst, torch.ones_like(dst)), "the data is copied for real"
    assert sim.now == 0.0 and sim.stream_ready(SimStream.COPY) == pytest.approx(1e-3)
    _copy(sim, 10 * MB, HostingTier.PAGEABLE)
    # queued behind the pinned copy on the one copy engine, then 1 ms at 10 GB/s; the host waited
    assert sim.now == pytest.approx(2e-3) and sim.blocked_s == pytest.approx(2e-3)
    _copy(sim, 10 * MB, HostingTier.MAPPED)
    assert sim.now == pytest.approx(3e-3)


def test_unregistered_host_memory_copies_as_pageable():
    sim = SimDevice(LINK)
    src, dst = torch.ones(10 * MB, dtype=torch.uint8), torch.empty(10 * MB, dtype=torch.uint8)
    with sim.on_copy_stream():
        dst.copy_(src, non_blocking=True)
    assert sim.now == pytest.approx(1e-3)


def test_copies_on_two_streams_share_the_one_host_to_device_copy_engine():
    sim = SimDevice(LINK)
    _copy(sim, 25 * MB, HostingTier.PINNED)  # copy stream, 1 ms
    src, dst = torch.ones(25 * MB, dtype=torch.uint8), torch.empty(25 * MB, dtype=torch.uint8)
    sim.register_host_memory([src], HostingTier.PINNED)
    with sim.on_stream(SimStream.COMPUTE):
        dst.copy_(src, non_blocking=True)
    assert sim.stream_ready(SimStream.COMPUTE) == pytest.approx(2e-3), "it waited for the copy engine"


def test_kernels_launch_asynchronously_and_start_only_after_the_events_their_stream_waits_for():
    sim = SimDevice(LINK)
    _copy(sim, 25 * MB, HostingTier.PINNED)
    sim.launch_kernel(0.5e-3)
    assert sim.now == 0.0 and sim.stream_ready(SimStream.COMPUTE) == pytest.approx(0.5e-3), \
        "without a wait the kernel does not queue behind the copy"
    sim.compute_waits(sim.record_copy())
    sim.launch_kernel(0.5e-3)
    assert sim.stream_ready(SimStream.COMPUTE) == pytest.approx(1.5e-3)
    sim.synchronize()
    assert sim.now == pytest.approx(1.5e-3)


def test_a_kernel_that_reads_a_buffer_before_its_copy_landed_is_a_hazard():
    sim = SimDevice(LINK)
    _, dst = _copy(sim, 25 * MB, HostingTier.PINNED)
    with pytest.raises(StreamHazardError, match="missing wait"):
        sim.launch_kernel(1e-4, reads=[dst])


def test_a_copy_over_a_buffer_a_queued_kernel_still_reads_is_a_hazard():
    sim = SimDevice(LINK)
    _, dst = _copy(sim, 25 * MB, HostingTier.PINNED)
    sim.compute_waits(sim.record_copy())
    sim.launch_kernel(5e-3, reads=[dst])
    src = torch.zeros(25 * MB, dtype=torch.uint8)
    sim.register_host_memory([src], HostingTier.PINNED)
    with pytest.raises(StreamHazardError, match="overwrites a buffer still in use"), sim.on_copy_stream():
        dst.copy_(src)


def _stream_on_sim(case, tier: HostingTier, depth: int, resident, sim: SimDevice):
    model, inputs = case.build(), case.inputs()
    expected = case.run(model, inputs)
    streamer = apply_layer_streaming(model, sim, StreamingConfig(
        prefetch_depth=depth, resident=resident, hosting={k: tier for k in _keys(model)}))
    sim.register_streamer(streamer)
    sim.charge_layer_compute(streamer, {layer.key: 1e-4 for layer in streamer.layers})
    return model, inputs, expected, streamer


def _keys(model) -> list[str]:
    from offload_core.layout import declared_layer_groups, resolve_layer_group

    return [f"{g}.{i}" for g in declared_layer_groups(model) for i in range(len(resolve_layer_group(model, g).layers))]


@pytest.mark.parametrize("depth,resident", [(1, 0), (2, 1)])
@pytest.mark.parametrize("tier", list(HostingTier), ids=lambda t: t.value)
@pytest.mark.parametrize("case", [WAN, FLUX], ids=lambda c: c.name)
def test_streaming_on_the_simulator_is_bitwise_equal_hazard_free_and_meets_its_predicted_peak(case, tier, depth,
                                                                                              resident):
    sim = SimDevice(LINK)
    model, inputs, expected, streamer = _stream_on_sim(case, tier, depth, resident, sim)
    for _ in range(2):
        streamer.prepare_for_use()
        assert torch.equal(case.run(model, inputs), expected)
        assert torch.equal(case.run(model, inputs), expected)
        streamer.finish_use()
    assert streamer.meter.peak_bytes == streamer.predicted_peak_bytes()
    assert sim.kernels == 2 * 2 * len(streamer.layers)
    sim.synchronize()
    assert sim.now >= 2 * 2 * len(streamer.layers) * 1e-4, "every layer's kernel ran on the clock"


def test_the_simulator_catches_an_engine_that_skips_the_wait_for_its_copy(monkeypatch):
    sim = SimDevice(LINK)
    model, inputs, _, streamer = _stream_on_sim(WAN, HostingTier.PINNED, 1, 0, sim)
    monkeypatch.setattr(sim, "compute_waits", lambda event: None)
    with pytest.raises(StreamHazardError, match="reads a buffer whose last write"):
        WAN.run(model, inputs)


def test_the_simulator_catches_an_engine_that_refills_a_slot_a_queued_kernel_still_reads(monkeypatch):
    sim = SimDevice(LINK)
    model, inputs, _, streamer = _stream_on_sim(WAN, HostingTier.PINNED, 1, 0, sim)
    monkeypatch.setattr(sim, "copy_waits", lambda event: None)
    with pytest.raises(StreamHazardError, match="overwrites a buffer still in use"):
        WAN.run(model, inputs)


def test_bad_link_rates_are_refused():
    with pytest.raises(ValueError, match="pinned_Bps"):
        SimLink(pinned_Bps=0)
    with pytest.raises(ValueError, match="launch_s"):
        SimLink(launch_s=-1.0)


def test_compute_time_is_required_for_every_layer(remove_after):
    sim = SimDevice(LINK)
    model = WAN.build()
    streamer = remove_after(apply_layer_streaming(model, sim))
    with pytest.raises(ValueError, match="no compute time for layers"):
        sim.charge_layer_compute(streamer, {})
