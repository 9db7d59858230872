"""Parking non-layer weights between uses: the headroom gate both ways, placeholders, round trip."""
from __future__ import annotations

import torch
from torch import nn

from offload_core.layout import placeholder
from offload_core.residency.parking import Parking, ParkVerdict


class Component(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(8, 16)  # non-layer
        self.blocks = nn.ModuleList([nn.Linear(16, 16) for _ in range(3)])  # layer weights
        self.head = nn.Linear(16, 4).to(torch.float64)  # another dtype
        self.register_buffer("scale", torch.tensor(2.0))

    def forward(self, x):
        x = self.embed(x)
        for b in self.blocks:
            x = b(x)
        return self.head(x.double()) * self.scale


def layer_weights(model):
    return list(model.blocks.parameters())


NONLAYER_BYTES = (8 * 16 + 16) * 4 + (16 * 4 + 4) * 8


def test_parks_when_the_non_layer_bytes_exceed_a_tenth_of_the_headroom():
    model, plain = Component(), Component()
    parking = Parking("c", model, "cpu", exclude=layer_weights(model))
    assert parking.nbytes == NONLAYER_BYTES
    decision = parking.park_if_it_pays(headroom=NONLAYER_BYTES * 10 - 1)
    assert decision.verdict is ParkVerdict.PARKED and parking.parked
    assert model.embed.weight.numel() == 0 and model.head.weight.numel() == 0
    assert model.blocks[0].weight.numel() == 16 * 16, "layer weights belong to the streamer, not to parking"
    assert model.scale.numel() == 1, "buffers are not parked"
    assert sum(t.numel() * t.element_size() for t in parking.parked_tensors()) == NONLAYER_BYTES
    parking.restore()
    x = torch.randn(2, 8)
    with torch.no_grad():
        assert torch.equal(model(x), plain(x))
    assert parking.bytes_restored == NONLAYER_BYTES


def test_keeps_weights_and_drops_the_host_copy_when_headroom_is_ample():
    model = Component()
    parking = Parking("c", model, "cpu", exclude=layer_weights(model))
    parking.park_if_it_pays(headroom=0)  # short: parks, host copy held
    parking.restore()
    assert parking.parked_tensors(), "the host copy is kept while parking pays"
    decision = parking.park_if_it_pays(headroom=NONLAYER_BYTES * 10)
    assert decision.verdict is ParkVerdict.KEPT and not parking.parked
    assert parking.parked_tensors() == (), "an unused host copy is host memory spent for nothing"
    assert model.embed.weight.numel() == 8 * 16


def test_weights_are_copied_to_the_host_once_across_uses():
    model = Component()
    parking = Parking("c", model, "cpu", exclude=layer_weights(model))
    for _ in range(3):
        parking.park_if_it_pays(headroom=0)
        parking.restore()
    assert parking.bytes_to_host == NONLAYER_BYTES
    assert parking.bytes_restored == 3 * NONLAYER_BYTES


def test_placeholders_are_shared_per_device_and_dtype():
    a, b = Component(), Component()
    for m in (a, b):
        Parking("c", m, "cpu", exclude=layer_weights(m)).park()
    shared32 = placeholder("cpu", torch.float32)
    for p in (a.embed.weight, a.embed.bias, b.embed.weight):
        assert p.data.data_ptr() == shared32.data_ptr() and p.dtype == torch.float32
    assert a.head.weight.data.data_ptr() == placeholder("cpu", torch.float64).data_ptr()
    assert placeholder("cpu", torch.float64) is not shared32


def test_restored_weights_are_a_fresh_device_allocation_not_the_host_copy():
    model = Component()
    parking = Parking("c", model, "cpu", exclude=layer_weights(model))
    parking.park()
    host_ptrs = {t.data_ptr() for t in parking.parked_tensors()}
    parking.restore()
    assert model.embed.weight.data_ptr() not in host_ptrs


def test_a_component_of_layer_weights_only_has_nothing_to_park():
    blocks = nn.ModuleList([nn.Linear(4, 4)])
    parking = Parking("b", blocks, "cpu", exclude=list(blocks.parameters()))
    assert parking.park_if_it_pays(headroom=0).verdict is ParkVerdict.EMPTY


def test_the_gate_reads_the_configured_cpu_capacity_both_ways(cpu_capacity):
    model = Component()
    parking = Parking("c", model, "cpu", exclude=layer_weights(model))
    cpu_capacity(NONLAYER_BYTES * 5)  # short: the weights are 20 % of headroom
    assert parking.park_if_it_pays().verdict is ParkVerdict.PARKED
    parking.restore()
    cpu_capacity(NONLAYER_BYTES * 100)  # ample: 1 %
    assert parking.park_if_it_pays().verdict is ParkVerdict.KEPT and not parking.parked


MiB = 1 << 20


def test_parking_does_not_count_on_cached_blocks_too_small_for_a_slot(cpu_device):
    from offload_core.streaming.headroom import CachedBlocks, Rounding
    from tests.offload_core.fake_allocator import FakeAllocator

    device, capacity = cpu_device
    model = Component()
    parking = Parking("c", model, "cpu", exclude=layer_weights(model), min_block=4 * MiB)
    capacity(NONLAYER_BYTES * 5)  # short by the driver's figure alone
    # 64 MiB cached, but in 2 MiB holes between live blocks: none serves a 4 MiB slot.
    holes = (2 * MiB,) * 32
    device.set_allocator(FakeAllocator(CachedBlocks(Rounding.CUDA_CACHING, 96 * MiB, 0, sum(holes), 0, holes)))
    decision = parking.park_if_it_pays()
    assert decision.verdict is ParkVerdict.PARKED, "reserved - allocated would have called 64 MiB of holes headroom"
    assert decision.parts.cached_free == 64 * MiB and decision.parts.cached_usable == 0
    parking.restore()
    one_big = (*holes, 8 * MiB)
    device.set_allocator(FakeAllocator(CachedBlocks(Rounding.CUDA_CACHING, 96 * MiB, 0, sum(one_big), 0, one_big)))
    decision = parking.park_if_it_pays()
    assert decision.verdict is ParkVerdict.KEPT and decision.parts.largest_cached_block == 8 * MiB


def test_parking_counts_a_neighbours_outstanding_lease_out_of_headroom(cpu_device, caplog):
    device, capacity = cpu_device
    model = Component()
    parking = Parking("c", model, "cpu", exclude=layer_weights(model))
    capacity(NONLAYER_BYTES * 100)  # ample: 1 %
    assert parking.park_if_it_pays().verdict is ParkVerdict.KEPT
    device.set_neighbours(lambda: NONLAYER_BYTES * 95)  # leased next door, not allocated yet
    caplog.clear()
    with caplog.at_level("INFO", logger="offload_core.residency.parking"):
        assert parking.park_if_it_pays().verdict is ParkVerdict.PARKED
        parking.restore()
        assert parking.park_if_it_pays().verdict is ParkVerdict.PARKED
    lines = [r.message for r in caplog.records if r.message.startswith("parking c:")]
    assert len(lines) == 1, "one line when the verdict changes, none when it repeats"
    assert f"neighbours' outstanding leases {NONLAYER_BYTES * 95} B" in lines[0]
