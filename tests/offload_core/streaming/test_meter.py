"""The device weight meter: kept from binds and releases (O(1)), audited against the parameter walk."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from offload_core.host.tier import HostingTier
from offload_core.layout import placeholder
from offload_core.streaming import meter as meter_module
from offload_core.streaming.engine import StreamingConfig, apply_layer_streaming
from offload_core.streaming.meter import DeviceWeightMeter
from tests.offload_core.tiny_models import ALL_CASES, WAN

CPU = torch.device("cpu")


def _bytes(*tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def test_the_walk_counts_each_device_storage_once_and_skips_placeholders():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4, bias=False))
    model[1].weight = model[0].weight  # tied: one storage
    meter = DeviceWeightMeter(model, "cpu")
    assert meter.current_bytes == meter.walk() == _bytes(model[0].weight, model[0].bias)
    model[0].bias.data = placeholder(CPU, torch.float32)
    assert meter.walk() == _bytes(model[0].weight)


def test_views_of_one_allocation_count_the_whole_allocation():
    model = nn.Linear(4, 4)
    slot = torch.empty(1024, dtype=torch.uint8)
    model.weight.data = slot[:64].view(torch.float32).view(4, 4)
    model.bias.data = slot[512:528].view(torch.float32)
    assert DeviceWeightMeter(model, "cpu").walk() == 1024


def test_parameters_on_another_device_are_not_counted():
    model = nn.Linear(4, 4, device="meta")
    assert DeviceWeightMeter(model, "cpu").current_bytes == 0


def test_owners_bound_to_one_allocation_count_it_once_until_the_last_releases():
    model = nn.Linear(4, 4)
    meter = DeviceWeightMeter(model, "cpu")
    base = meter.current_bytes
    slot = torch.empty(2048, dtype=torch.uint8)
    meter.bind("a", slot[:64])
    meter.bind("b", slot[1024:1088])
    assert meter.current_bytes == base + 2048
    meter.release("a")
    assert meter.current_bytes == base + 2048, "b still views the slot"
    meter.release("b")
    meter.release("b")  # releasing what is not bound changes nothing
    assert meter.current_bytes == base and meter.peak_bytes == base + 2048


def test_rebinding_an_owner_moves_its_bytes_instead_of_adding_them():
    meter = DeviceWeightMeter(nn.Linear(4, 4, device="meta"), "cpu")
    first, second = torch.empty(512, dtype=torch.uint8), torch.empty(1536, dtype=torch.uint8)
    meter.bind("layer", first)
    meter.bind("layer", second)
    assert meter.current_bytes == 1536 and meter.peak_bytes == 1536


def test_moves_change_the_count_and_a_reset_peak_starts_from_now():
    meter = DeviceWeightMeter(nn.Linear(4, 4, device="meta"), "cpu")
    meter.moved(1000)
    meter.moved(-600)
    assert (meter.current_bytes, meter.peak_bytes) == (400, 1000)
    meter.reset_peak()
    assert meter.peak_bytes == 400


def test_a_streamed_request_never_walks_the_parameters(monkeypatch, remove_after):
    model, inputs = WAN.build(), WAN.inputs()
    expected = WAN.run(model, inputs)
    streamer = remove_after(apply_layer_streaming(model, "cpu", StreamingConfig(prefetch_depth=1, resident=1)))

    def no_walks(*_args):
        raise AssertionError("the meter walked the parameters during a request")

    monkeypatch.setattr(meter_module, "walked_device_bytes", no_walks)
    streamer.prepare_for_use()
    assert torch.equal(WAN.run(model, inputs), expected)
    streamer.finish_use()
    assert streamer.meter.peak_bytes == streamer.predicted_peak_bytes()
    assert streamer.meter.current_bytes == streamer.non_layer_bytes


def audit_at_every_hook(meter: DeviceWeightMeter, modules) -> list[int]:
    """Check incremental == walked after every pre- and post-hook of ``modules``; returns the hooks seen."""
    seen: list[int] = []

    def check(*_args) -> None:
        assert meter.current_bytes == meter.walk(), f"incremental {meter.current_bytes} != walked {meter.walk()}"
        seen.append(meter.current_bytes)

    for module in modules:
        module.register_forward_pre_hook(check)  # after the engine's hooks: sees what they did
        module.register_forward_hook(check, always_call=True)
    return seen


@pytest.mark.parametrize("depth,resident", [(1, 0), (2, 1), (1, 0.5)])
@pytest.mark.parametrize("tier", list(HostingTier), ids=lambda t: t.value)
@pytest.mark.parametrize("case", ALL_CASES, ids=lambda c: c.name)
def test_incremental_bytes_equal_the_walk_at_every_hook(case, tier, depth, resident, remove_after):
    model, inputs = case.build(), case.inputs()
    streamer = remove_after(apply_layer_streaming(model, "cpu", StreamingConfig(
        prefetch_depth=depth, resident=resident, hosting={key: tier for key in _layer_keys(model)})))
    seen = audit_at_every_hook(streamer.meter, [model, *(layer.module for layer in streamer.layers)])
    for _request in range(2):
        streamer.prepare_for_use()
        assert streamer.meter.current_bytes == streamer.meter.walk()
        case.run(model, inputs)
        streamer.finish_use()
        assert streamer.meter.current_bytes == streamer.meter.walk() == streamer.non_layer_bytes
    assert len(seen) >= 4 * len(streamer.layers), "the audit must have run at every layer's hooks"
    assert max(seen) == streamer.meter.peak_bytes == streamer.predicted_peak_bytes()
    streamer.remove()


def _layer_keys(model: nn.Module) -> list[str]:
    from offload_core.layout import declared_layer_groups, resolve_layer_group

    return [f"{path}.{i}" for path in declared_layer_groups(model)
            for i in range(len(resolve_layer_group(model, path).layers))]
