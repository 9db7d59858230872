"""The device context: one per device, synchronous no-ops on CPU, headroom from configured facts."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from offload_core.streaming.device import DeviceCapacity, get_device, normalize_device
from offload_core.streaming.meter import DeviceWeightMeter


def test_one_context_per_device_created_lazily():
    first = get_device("cpu")
    assert get_device(torch.device("cpu")) is first
    assert first.copy_stream is None, "CPU has no copy stream: copies are synchronous"


def test_cpu_stream_and_event_operations_are_synchronous_no_ops():
    device = get_device("cpu")
    with device.on_copy_stream():
        copied = torch.ones(3).clone()
    assert device.record_copy() is None and device.record_compute() is None
    device.compute_waits(None)
    device.copy_waits(None)
    device.copy_waits_for_compute()
    device.compute_waits_for_copies()
    assert torch.equal(copied, torch.ones(3))


def test_cpu_headroom_is_configured_capacity_minus_tracked_weight_bytes(cpu_capacity):
    cpu_capacity(10_000)
    device = get_device("cpu")
    before = device.headroom_bytes()
    model = nn.Linear(10, 10)  # 440 B of weights
    meter = DeviceWeightMeter(model, "cpu", track_headroom=True)
    assert device.headroom_bytes() == before - 440
    del meter  # tracked weakly: a dropped meter stops counting
    assert device.headroom_bytes() == before


def test_a_closed_meter_stops_counting_in_headroom_while_its_model_still_lives(cpu_capacity):
    cpu_capacity(10_000)
    device = get_device("cpu")
    before = device.headroom_bytes()
    model = nn.Linear(10, 10)
    meter = DeviceWeightMeter(model, "cpu", track_headroom=True)
    assert device.headroom_bytes() == before - 440
    meter.close()  # explicit, as LayerStreamer.remove() does: no reliance on garbage collection
    assert device.headroom_bytes() == before
    assert model.weight.numel() == 100, "closing the meter must not touch the model"


def test_without_a_configured_capacity_cpu_headroom_is_host_ram_available():
    import psutil

    device = get_device("cpu")
    saved = device.facts
    try:
        device.configure(DeviceCapacity())
        assert abs(device.headroom_bytes() - psutil.virtual_memory().available) < 512 * 2**20
    finally:
        device.configure(saved)


def test_negative_capacity_is_refused():
    with pytest.raises(ValueError, match="capacity_bytes"):
        DeviceCapacity(capacity_bytes=-1)


def test_devices_are_normalized_to_one_key():
    assert normalize_device("cpu") == torch.device("cpu")
