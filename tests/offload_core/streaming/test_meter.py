"""The independent device weight meter: distinct storages, placeholders, peaks, hooks."""
from __future__ import annotations

import torch
from torch import nn

from offload_core.layout import placeholder
from offload_core.streaming.meter import DeviceWeightMeter


def _bytes(*tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def test_counts_each_device_storage_once_and_skips_placeholders():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4, bias=False))
    model[1].weight = model[0].weight  # tied: one storage
    meter = DeviceWeightMeter(model, "cpu")
    assert meter.current_bytes == _bytes(model[0].weight, model[0].bias)
    model[0].bias.data = placeholder(torch.device("cpu"), torch.float32)
    assert meter.current_bytes == _bytes(model[0].weight)


def test_views_of_one_allocation_count_the_whole_allocation():
    model = nn.Linear(4, 4)
    slot = torch.empty(1024, dtype=torch.uint8)
    model.weight.data = slot[:64].view(torch.float32).view(4, 4)
    model.bias.data = slot[512:528].view(torch.float32)
    assert DeviceWeightMeter(model, "cpu").current_bytes == 1024


def test_peak_is_kept_until_reset_and_hooks_sample_it():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    meter = DeviceWeightMeter(model, "cpu")
    full = meter.current_bytes
    for p in model.parameters():
        p.data = placeholder(torch.device("cpu"), torch.float32)
    assert meter.current_bytes == 0 and meter.peak_bytes == full
    meter.reset_peak()
    assert meter.peak_bytes == 0

    weight = torch.randn(4, 4)
    model[0].register_forward_pre_hook(lambda *_: setattr(model[0].weight, "data", weight) or None)
    model[0].register_forward_hook(lambda *_: setattr(
        model[0].weight, "data", placeholder(torch.device("cpu"), torch.float32)) or None)
    model[0].bias.data = torch.zeros(4)
    model[1].weight.data, model[1].bias.data = torch.eye(4), torch.zeros(4)
    meter.attach([model[0]])  # after the "engine" hooks above
    model(torch.randn(2, 4))
    assert meter.peak_bytes == _bytes(weight) + 64 + 2 * 16  # + eye(4) + two biases
    meter.detach()
    meter.reset_peak()
    model(torch.randn(2, 4))
    assert meter.peak_bytes == 64 + 2 * 16, "a detached meter must not sample at hooks"


def test_parameters_on_another_device_are_not_counted():
    model = nn.Linear(4, 4, device="meta")
    assert DeviceWeightMeter(model, "cpu").current_bytes == 0
