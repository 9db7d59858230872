"""Staged copies: PAGEABLE and MAPPED layers reach the device through pinned staging buffers."""
from __future__ import annotations

import pytest
import torch

from offload_core.buffers import RegionMap
from offload_core.host.tier import HostingTier
from offload_core.layout import declared_layer_groups, resolve_layer_group
from offload_core.streaming.copier import CopyFailed, ThreadCopier
from offload_core.streaming.device import Device, DeviceCapacity
from offload_core.streaming.engine import StreamingConfig, apply_layer_streaming
from testing.sim import SimDevice, SimLink
from tests.offload_core.tiny_models import ALL_CASES, FLUX, WAN

TIERS = (HostingTier.PINNED, HostingTier.PAGEABLE, HostingTier.MAPPED)


def _keys(model) -> list[str]:
    return [f"{g}.{i}" for g in declared_layer_groups(model) for i in range(len(resolve_layer_group(model, g).layers))]


def _mixed(model) -> dict[str, HostingTier]:
    """Tiers in turn, so pinned layers sit between staged ones in the streamed order."""
    return {key: TIERS[i % 3] for i, key in enumerate(_keys(model))}


class ThreadedCpuDevice(Device):
    """CPU, with a real host copier thread, as on CUDA: fills run concurrently with the forward."""

    def __init__(self):
        super().__init__(torch.device("cpu"), DeviceCapacity())

    def host_copier(self, name: str, threads: int | None = None):
        return ThreadCopier(name, threads or 1)


def test_staging_bytes_are_the_buffers_times_the_largest_staged_layer_per_dtype(remove_after):
    model = FLUX.build()
    streamer = remove_after(apply_layer_streaming(model, "cpu", StreamingConfig(hosting=_mixed(model), staging_buffers=3)))
    staged = [layer for layer in streamer.layers if layer.tier is not HostingTier.PINNED]
    assert streamer.staging_bytes == 3 * RegionMap.covering(layer.layout for layer in staged).nbytes > 0
    streamer.prepare_for_use()
    assert streamer.staging.staging_bytes == sum(b.nbytes for b in streamer.staging._buffers), "allocated = predicted"
    streamer.remove()


def test_pinned_layers_and_staging_switched_off_take_no_staging_bytes(remove_after):
    model = WAN.build()
    pinned = remove_after(apply_layer_streaming(model, "cpu", StreamingConfig(hosting={k: HostingTier.PINNED for k in _keys(model)})))
    assert pinned.staging is None and pinned.staging_bytes == 0
    pinned.remove()
    off = remove_after(apply_layer_streaming(model, "cpu", StreamingConfig(staged_copies=False)))
    assert off.staging is None and off.staging_bytes == 0


def test_staging_buffers_must_be_a_positive_count():
    with pytest.raises(ValueError, match="staging_buffers"):
        StreamingConfig(staging_buffers=0)
    with pytest.raises(TypeError, match="staged_copies"):
        StreamingConfig(staged_copies="yes")


@pytest.mark.parametrize("depth,resident", [(1, 0), (2, 0), (1, 2)])
@pytest.mark.parametrize("case", ALL_CASES, ids=lambda c: c.name)
def test_staged_streaming_with_a_real_copier_thread_is_bitwise_equal(case, depth, resident, remove_after):
    model, inputs = case.build(), case.inputs()
    expected = case.run(model, inputs)
    streamer = remove_after(apply_layer_streaming(model, ThreadedCpuDevice(), StreamingConfig(
        prefetch_depth=depth, resident=resident, hosting=_mixed(model))))
    for _ in range(2):
        streamer.prepare_for_use()
        for _ in range(3):
            assert torch.equal(case.run(model, inputs), expected)
        streamer.finish_use()
    assert streamer.meter.peak_bytes == streamer.predicted_peak_bytes()
    assert streamer.staging.fills > 0
    streamer.remove()


@pytest.mark.parametrize("keep", [False, True], ids=["released", "kept"])
def test_staged_layers_never_block_the_launch_thread_and_copy_only_from_pinned_memory(keep, remove_after):
    sim = SimDevice(SimLink())
    model, inputs = WAN.build(), WAN.inputs()
    expected = WAN.run(model, inputs)
    streamer = remove_after(apply_layer_streaming(model, sim, StreamingConfig(resident=1, hosting=_mixed(model), keep_resident=keep)))
    sim.register_streamer(streamer)
    sim.charge_layer_compute(streamer, {layer.key: 1e-5 for layer in streamer.layers})
    for _ in range(3):
        streamer.prepare_for_use()
        assert torch.equal(WAN.run(model, inputs), expected)
        assert torch.equal(WAN.run(model, inputs), expected)
        streamer.finish_use()
    assert sim.copy_blocked_s == 0.0, "a pageable or mapped copy blocked the thread that launches kernels"
    assert streamer.staging.restarts == 0, "the copier filled exactly the layers asked for, in order"


def test_without_staging_pageable_copies_block_the_launch_thread(remove_after):
    sim = SimDevice(SimLink())
    model, inputs = WAN.build(), WAN.inputs()
    streamer = remove_after(apply_layer_streaming(model, sim, StreamingConfig(staged_copies=False)))
    sim.register_streamer(streamer)
    sim.charge_layer_compute(streamer, {layer.key: 1e-5 for layer in streamer.layers})
    WAN.run(model, inputs)
    assert sim.copy_blocked_s > 0 and sim.copier_wait_s == 0.0


def test_a_failed_fill_surfaces_in_the_forward_that_needed_it(monkeypatch, remove_after):
    model, inputs = WAN.build(), WAN.inputs()
    streamer = remove_after(apply_layer_streaming(model, ThreadedCpuDevice()))

    def refuse(_regions, *_how):
        raise OSError("page fault reading the mapping")
    monkeypatch.setattr(streamer.layers[1].host, "copy_host_bytes", refuse)  # the fill copies hosted bytes as they are
    with pytest.raises(CopyFailed, match="page fault") as raised:
        WAN.run(model, inputs)
    assert isinstance(raised.value.__cause__, OSError), "typed, with the copier's error as its cause"
    streamer.remove()  # the failure left nothing half-done: buffers unlocked, the copier joined
    assert streamer.staging._copier is None and all(p.numel() > 0 for p in model.parameters())


@pytest.mark.parametrize("refuse", [False, True], ids=["pinned", "refused"])
def test_a_refused_staging_pin_copies_unstaged_and_a_granted_one_never_blocks(refuse, remove_after):
    sim = SimDevice(SimLink(), refuse_pins=refuse)
    model, inputs = WAN.build(), WAN.inputs()
    expected = WAN.run(model, inputs)
    streamer = remove_after(apply_layer_streaming(model, sim, StreamingConfig(hosting=_mixed(model))))
    sim.register_streamer(streamer)
    sim.charge_layer_compute(streamer, {layer.key: 1e-5 for layer in streamer.layers})
    streamer.prepare_for_use()
    assert torch.equal(WAN.run(model, inputs), expected)
    streamer.finish_use()
    staging = streamer.staging
    if refuse:
        # No pageable staging buffer: it would add a host memcpy to a copy that blocks anyway.
        assert staging.refusal is not None and staging.host_tensors() == () and streamer.staging_bytes == 0
        assert staging.fills == 0 and sim.copy_blocked_s > 0, "the staged layers went the driver's blocking way"
    else:
        assert staging.refusal is None and staging.fills > 0 and sim.copy_blocked_s == 0.0
