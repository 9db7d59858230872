"""The simulator's CUDA facts beyond bandwidth: host-blocking pinned copies, per-copy latency, launch
cost, the launch thread's waits on the copier, seeded copier jitter and a slow stretch."""
from __future__ import annotations

import random

import pytest
import torch

from offload_core.host.tier import HostingTier
from offload_core.streaming.engine import StreamingConfig, apply_layer_streaming
from testing.sim import SimDevice, SimLink, SimStream, SlowStretch, StreamHazardError
from tests.offload_core.streaming.test_sim import _keys
from tests.offload_core.tiny_models import WAN

MB = 10**6
LINK = SimLink(pinned_Bps=25e9, pageable_Bps=10e9, mapped_Bps=10e9, host_memcpy_Bps=12e9)


def _pinned_copy(sim: SimDevice, nbytes: int, non_blocking: bool) -> None:
    src, dst = torch.ones(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
    sim.register_host_memory([src], HostingTier.PINNED)
    with sim.on_copy_stream():
        dst.copy_(src, non_blocking=non_blocking)


def test_a_pinned_copy_without_non_blocking_blocks_the_host_until_it_lands():
    sim = SimDevice(LINK)
    _pinned_copy(sim, 25 * MB, non_blocking=True)
    assert sim.now == 0.0 and sim.blocked_s == 0.0
    _pinned_copy(sim, 25 * MB, non_blocking=False)
    assert sim.now == pytest.approx(2e-3) and sim.blocked_s == pytest.approx(2e-3)


def test_every_copy_pays_its_latency_and_every_launch_its_host_time():
    sim = SimDevice(SimLink(copy_latency_s=1e-5, launch_s=2e-6))
    _pinned_copy(sim, 25 * MB, non_blocking=True)
    _pinned_copy(sim, 25 * MB, non_blocking=True)
    assert sim.stream_ready(SimStream.COPY) == pytest.approx(2 * (1e-3 + 1e-5))
    assert sim.now == pytest.approx(2 * 2e-6), "issuing a copy costs the host its launch time"
    sim.launch_kernel(1e-3)
    assert sim.now == pytest.approx(3 * 2e-6)


def test_copier_jitter_is_seeded_bounded_and_centred():
    link = SimLink(host_memcpy_Bps=1e9, copier_jitter=0.2, seed=7)
    draws = [link.memcpy_s(MB, 0.0, random.Random(7)) for _ in range(2)]
    assert draws[0] == draws[1], "the same seed gives the same run"
    rng = random.Random(7)
    many = [link.memcpy_s(MB, 0.0, rng) for _ in range(2000)]
    assert all(0.8e-3 <= s <= 1.2e-3 for s in many)
    assert sum(many) / len(many) == pytest.approx(1e-3, rel=0.02), "zero-mean: the bound's sum is unbiased"


def test_a_slow_stretch_runs_the_copier_at_its_fraction_of_speed_inside_it_only():
    link = SimLink(host_memcpy_Bps=1e9, copier_slow=SlowStretch(1e-3, 3e-3, 0.5))
    rng = random.Random(0)
    assert link.memcpy_s(MB, 5e-3, rng) == pytest.approx(1e-3), "after the stretch: full speed"
    assert link.memcpy_s(MB, 1e-3, rng) == pytest.approx(2e-3), "inside: half speed"
    # From 0.5 ms: 0.5 ms at full speed, then the remaining 0.5 MB at half speed (1 ms).
    assert link.memcpy_s(MB, 0.5e-3, rng) == pytest.approx(1.5e-3)
    # From 2.5 ms: 0.5 ms inside does 0.25 MB, the remaining 0.75 MB after it at full speed.
    assert link.memcpy_s(MB, 2.5e-3, rng) == pytest.approx(0.5e-3 + 0.75e-3)


def _staged_wan(sim: SimDevice, **config):
    model, inputs = WAN.build(), WAN.inputs()
    expected = WAN.run(model, inputs)
    streamer = apply_layer_streaming(model, sim, StreamingConfig(
        hosting={k: HostingTier.PAGEABLE for k in _keys(model)}, **config))
    sim.register_streamer(streamer)
    sim.charge_layer_compute(streamer, {layer.key: 1e-6 for layer in streamer.layers})
    return model, inputs, expected, streamer


def test_the_launch_threads_waits_for_a_slow_copier_count_as_blocked(remove_after):
    sim = SimDevice(SimLink(host_memcpy_Bps=1e9))  # a copier at 1 GB/s: far behind 1 us layers
    model, inputs, expected, streamer = _staged_wan(sim)
    remove_after(streamer)
    assert torch.equal(WAN.run(model, inputs), expected)
    assert sim.copier_wait_s > 0 and sim.blocked_s >= sim.copier_wait_s


def test_a_copier_that_skips_its_wait_for_the_copy_out_of_a_buffer_is_a_hazard(monkeypatch, remove_after):
    # The copier refills a staging buffer at once; the DMA out of it (1 GB/s) is still reading.
    sim = SimDevice(SimLink(pinned_Bps=1e9, host_memcpy_Bps=1e12))
    model, inputs, _, streamer = _staged_wan(sim)
    remove_after(streamer)
    monkeypatch.setattr(sim, "host_waits", lambda event: None)
    with pytest.raises(StreamHazardError, match="overwrites a buffer still in use"):
        WAN.run(model, inputs)


def test_bad_overheads_are_refused():
    with pytest.raises(ValueError, match="copy_latency_s"):
        SimLink(copy_latency_s=-1.0)
    with pytest.raises(ValueError, match="copier_jitter"):
        SimLink(copier_jitter=1.0)
    with pytest.raises(ValueError, match="SlowStretch"):
        SlowStretch(2.0, 1.0)


def test_a_fill_split_over_copier_threads_runs_at_their_rate_up_to_the_bus():
    link = SimLink(host_memcpy_Bps=5e9, host_memcpy_max_Bps=28e9)
    assert link.memcpy_Bps(1) == 5e9 and link.memcpy_Bps(4) == 20e9 and link.memcpy_Bps(8) == 28e9
    sim = SimDevice(link)
    copier = sim.host_copier("copier", 4)
    dst, src = torch.empty(10**6, dtype=torch.uint8), torch.ones(10**6, dtype=torch.uint8)
    copier.submit(lambda: copier.copy([(dst, src)])).result()
    assert sim.now == pytest.approx(10**6 / 20e9) and torch.equal(dst, src)


def test_many_short_kernels_make_a_layer_launch_bound():
    sim = SimDevice(SimLink(launch_s=10e-6))
    sim.launch_kernel(100e-6, kernels=40)  # 40 launches of 10 us outlast 100 us of kernels
    assert sim.stream_ready(SimStream.COMPUTE) == pytest.approx(39 * 10e-6 + 100e-6 / 40), \
        "the last kernel starts after 39 launches"
    sim.synchronize()
    assert sim.now == pytest.approx(40 * 10e-6), "the step is the launches', not the kernels'"
    compute_bound = SimDevice(SimLink(launch_s=10e-6))
    compute_bound.launch_kernel(10e-3, kernels=40)
    compute_bound.synchronize()
    assert compute_bound.now == pytest.approx(10e-3)


def test_a_widen_that_reads_its_scales_back_stalls_the_thread_that_issued_the_copy(remove_after):
    from offload_core.quant import WeightFormat

    model = WAN.build()
    sim = SimDevice(SimLink(launch_s=1e-6, pinned_Bps=1e6))
    streamer = remove_after(apply_layer_streaming(model, sim, StreamingConfig(
        weights=WeightFormat.FP8, hosting={key: HostingTier.PINNED for key in _keys(model)})))
    assert sim.charge_widen(streamer, launches=5, syncs=2) > 0
    sim.register_streamer(streamer)
    sim.charge_layer_compute(streamer, {layer.key: 1e-6 for layer in streamer.layers})
    streamer.prepare_for_use()
    with torch.no_grad():
        WAN.run(model, WAN.inputs())
    assert sim.syncs > 0 and sim.blocked_s > 0, "each scale read waits for the slow copy"


def test_a_kernel_on_the_copy_stream_takes_sm_time_from_busy_compute():
    # compute keeps the SMs busy for 10 ms; a 2 ms widen on the copy stream ready at 1 ms runs on the
    # same SMs, so compute queued after it ends 2 ms later (the H200's FP8 step at 6 frames: +9 %)
    sim = SimDevice(SimLink())
    sim.launch_kernel(1e-3)
    with sim.on_copy_stream():
        sim._launch(SimStream.COPY, 2e-3)
    sim.launch_kernel(9e-3)
    sim.synchronize()
    assert sim.now == pytest.approx(12e-3), "streams order kernels; they do not add SMs"
    assert sim.stream_ready(SimStream.COPY) == pytest.approx(3e-3)


def test_a_copy_stream_kernel_fills_the_gaps_compute_leaves():
    from testing.sim_sms import SmTimeline

    sms = SmTimeline()
    assert sms.place(0.0, 1.0) == 1.0
    assert sms.place(3.0, 1.0) == 4.0
    assert sms.place(0.5, 2.5) == 4.5, "1 -> 3 free, then 4 -> 4.5: 2 + 0.5 s"
    assert sms.busy_s == pytest.approx(4.5)
    sms.forget_before(4.5)
    assert sms.busy_s == 0.0 and sms.place(5.0, 1.0) == 6.0
