"""Headroom that an allocation can really get: cached blocks by size, the allocator's rounding, the
process cap, neighbours' outstanding leases; and prefetch that waits for a neighbour's lease."""
from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
import torch

from offload_core.streaming.device import get_device
from offload_core.streaming.engine import StreamingConfig, apply_layer_streaming
from offload_core.streaming.headroom import (
    LARGE_SEGMENT,
    CachedBlocks,
    Headroom,
    HeadroomTimeout,
    Rounding,
    cuda_cached_blocks,
    segment_bytes,
)
from tests.offload_core.fake_allocator import FakeAllocator
from tests.offload_core.tiny_models import WAN

MiB = 1 << 20


def fragmented(split: tuple[int, ...], reclaimable: int = 0, small_free: int = 0) -> CachedBlocks:
    return CachedBlocks(Rounding.CUDA_CACHING, reserved=64 * MiB, reclaimable=reclaimable, split_free=sum(split),
                        small_free=small_free, split_blocks=split)


def test_cached_blocks_smaller_than_the_request_do_not_count():
    room = Headroom(4 * MiB, driver_free=0, neighbours_outstanding=0, blocks=fragmented((3 * MiB, 3 * MiB, 6 * MiB)),
                    usable_blocks=(6 * MiB,))
    assert room.cached_free == 12 * MiB, "the old figure would count all 12 MiB"
    assert room.usable_bytes == 6 * MiB and room.largest_cached_block == 6 * MiB
    assert room.allocations(4 * MiB) == 1, "two 4 MiB slots cannot both come from one 6 MiB block"
    assert room.fits(6 * MiB) and not room.fits(6 * MiB + 1)


def test_small_pool_blocks_never_serve_a_slot(cpu_device):
    device, capacity = cpu_device
    capacity(0)
    device.set_allocator(FakeAllocator(fragmented((), small_free=8 * MiB)))
    assert device.headroom(min_block=0).usable_bytes == 8 * MiB, "any-size requests may use them"
    assert device.headroom(min_block=2 * MiB).usable_bytes == 0, "a request over 1 MiB never comes from the small pool"


def test_whole_free_segments_count_as_new_memory_since_a_failed_allocation_reclaims_them(cpu_device):
    device, capacity = cpu_device
    capacity(0)
    device.set_allocator(FakeAllocator(fragmented((), reclaimable=40 * MiB)))
    room = device.headroom(min_block=12 * MiB)
    assert room.new_memory == 40 * MiB and room.allocations(12 * MiB) == 3


def test_a_request_under_ten_mib_needs_a_whole_twenty_mib_segment_when_no_block_serves_it():
    assert segment_bytes(3 * MiB, Rounding.CUDA_CACHING) == LARGE_SEGMENT
    assert segment_bytes(11 * MiB + 1, Rounding.CUDA_CACHING) == 12 * MiB, "rounded to 2 MiB from 10 MiB on"
    assert segment_bytes(3 * MiB, Rounding.EXACT) == 3 * MiB, "the CPU takes what it is asked"
    room = Headroom(3 * MiB, driver_free=19 * MiB, neighbours_outstanding=0, blocks=fragmented(()))
    assert not room.fits(3 * MiB), "19 MiB free is one MiB short of the segment a 3 MiB slot makes"
    roomier = Headroom(3 * MiB, driver_free=20 * MiB, neighbours_outstanding=0, blocks=fragmented(()))
    assert roomier.allocations(3 * MiB) == 6, "one 20 MiB segment serves six 3 MiB slots"


def test_the_process_cap_bounds_new_memory_whatever_the_driver_has():
    capped = CachedBlocks(Rounding.CUDA_CACHING, reserved=90 * MiB, reclaimable=10 * MiB, cap_bytes=100 * MiB)
    room = Headroom(12 * MiB, driver_free=10_000 * MiB, neighbours_outstanding=0, blocks=capped)
    assert room.new_memory == 20 * MiB, "cap 100 - reserved 90 + 10 reclaimable"


def test_neighbours_outstanding_leases_are_not_free_bytes(cpu_device):
    device, capacity = cpu_device
    capacity(100 * MiB)
    before = device.headroom_bytes()
    device.set_neighbours(lambda: 30 * MiB)
    room = device.headroom()
    assert room.neighbours_outstanding == 30 * MiB and room.usable_bytes == before - 30 * MiB
    device.set_neighbours(lambda: 10**12)
    assert device.headroom_bytes() == 0, "never negative"


def test_block_sizes_are_read_only_when_the_answer_depends_on_them(cpu_device):
    device, capacity = cpu_device
    capacity(64 * MiB)
    fake = FakeAllocator(fragmented((2 * MiB, 8 * MiB)))
    device.set_allocator(fake)
    device.headroom(min_block=4 * MiB, settled=lambda room: room.usable_bytes >= 32 * MiB)
    assert fake.detailed_reads == 0, "64 MiB of driver free already answers 'is 32 MiB there'"
    room = device.headroom(min_block=4 * MiB)
    assert fake.detailed_reads == 1 and room.usable_blocks == (8 * MiB,)
    device.headroom(min_block=512 * 1024)
    assert fake.detailed_reads == 1, "a small request never looks at large-pool blocks"


def test_slots_a_cached_block_serves_do_not_wait_for_a_neighbour(cpu_device):
    device, capacity = cpu_device
    capacity(20 * MiB)
    assert device.headroom().driver_free == 20 * MiB
    device.set_neighbours(lambda: 1)  # one byte short of the 20 MiB segment two 3 MiB slots would make
    device.set_allocator(FakeAllocator(fragmented((8 * MiB,))))  # but an 8 MiB hole holds both
    room = device.wait_for_neighbours(3 * MiB, 2, timeout_s=0.0, what="test")
    assert room.new_memory < LARGE_SEGMENT and room.allocations(3 * MiB) == 2


def _fake_cuda(monkeypatch, expandable: bool = False):
    """torch.cuda's allocator figures for one fragmented device: 100 MiB reserved, 40 MiB active;
    of the 60 MiB free, 16 + 6 MiB are large-pool holes, 2 MiB small-pool ones, 36 MiB whole segments."""
    stats = {"reserved_bytes.all.current": 100 * MiB, "active_bytes.all.current": 40 * MiB,
             "inactive_split_bytes.large_pool.current": 22 * MiB, "inactive_split_bytes.small_pool.current": 2 * MiB}
    segments = [
        {"device": 0, "segment_type": "large", "blocks": [{"state": "active_allocated", "size": 20 * MiB},
                                                          {"state": "inactive", "size": 16 * MiB}]},
        {"device": 0, "segment_type": "large", "blocks": [{"state": "inactive", "size": 6 * MiB},
                                                          {"state": "active_pending_free", "size": 20 * MiB}]},
        {"device": 0, "segment_type": "large", "blocks": [{"state": "inactive", "size": 36 * MiB}]},
        {"device": 1, "segment_type": "large", "blocks": [{"state": "inactive", "size": 99 * MiB},
                                                          {"state": "active_allocated", "size": 1 * MiB}]},
    ]
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda device: stats)
    monkeypatch.setattr(torch.cuda, "memory_snapshot", lambda: segments)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(total_memory=1000 * MiB))
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda device: 0.5)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True" if expandable else "")


def test_the_allocators_stats_split_its_cache_into_whole_segments_holes_and_small_blocks(monkeypatch):
    _fake_cuda(monkeypatch)
    cuda0 = torch.device("cuda", 0)
    cheap = cuda_cached_blocks(cuda0, detailed=False)
    assert (cheap.reclaimable, cheap.split_free, cheap.small_free) == (36 * MiB, 22 * MiB, 2 * MiB)
    assert cheap.split_blocks is None and cheap.cap_bytes == 500 * MiB
    detailed = cuda_cached_blocks(cuda0, detailed=True)
    assert sorted(detailed.split_blocks) == [6 * MiB, 16 * MiB], "other devices' and whole free segments left out"


def test_with_expandable_segments_no_free_byte_counts_as_a_whole_segment(monkeypatch):
    _fake_cuda(monkeypatch, expandable=True)
    blocks = cuda_cached_blocks(torch.device("cuda", 0), detailed=False)
    assert blocks.reclaimable == 0 and blocks.split_free == 58 * MiB


def _streamer(remove_after, config=StreamingConfig(prefetch_depth=1)):
    model = WAN.build()
    return model, remove_after(apply_layer_streaming(model, "cpu", config))


def test_prefetch_waits_when_a_neighbours_lease_covers_the_free_bytes(cpu_device, remove_after, caplog):
    device, capacity = cpu_device
    model, streamer = _streamer(remove_after)
    inputs = WAN.inputs()
    expected = WAN.run(WAN.build(), inputs)
    slots = streamer.ring.slot_bytes
    capacity(streamer.meter.current_bytes + slots + 1000)  # the slots fit the device...
    neighbour = {"outstanding": 2000}  # ...but not beside a neighbour's lease it has not used yet
    device.set_neighbours(lambda: neighbour["outstanding"])
    threading.Timer(0.3, lambda: neighbour.update(outstanding=0)).start()  # its call ends
    start = time.monotonic()
    with caplog.at_level("INFO", logger="offload_core.streaming.device"):
        out = WAN.run(model, inputs)
    streamer.finish_use()
    assert time.monotonic() - start >= 0.3, "the first prefetch allocated bytes a neighbour leased"
    assert torch.equal(out, expected)
    assert any("wait for neighbours' leases" in r.message and "2000 B" in r.message for r in caplog.records)


def test_prefetch_gives_up_with_a_typed_error_when_the_neighbour_keeps_its_lease(cpu_device, remove_after):
    device, capacity = cpu_device
    model, streamer = _streamer(remove_after, StreamingConfig(prefetch_depth=1, neighbour_wait_s=0.1))
    capacity(streamer.meter.current_bytes + streamer.ring.slot_bytes)
    device.set_neighbours(lambda: 1)
    with pytest.raises(HeadroomTimeout, match="neighbours' outstanding leases 1 B"):
        streamer.prepare_for_use()
    assert not streamer.ring.allocated, "no slot was allocated over the neighbour's bytes"


def test_a_shortfall_of_the_device_itself_is_not_waited_for(cpu_device, remove_after):
    device, capacity = cpu_device
    model, streamer = _streamer(remove_after, StreamingConfig(prefetch_depth=1, neighbour_wait_s=30.0))
    capacity(0)  # short whoever leases what: no neighbour's release would make room
    device.set_neighbours(lambda: 1000)
    start = time.monotonic()
    out = WAN.run(model, WAN.inputs())
    streamer.finish_use()
    assert time.monotonic() - start < 5.0 and torch.equal(out, WAN.run(WAN.build(), WAN.inputs()))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: fragments the real caching allocator")
def test_on_cuda_the_largest_cached_block_is_what_a_real_allocation_gets_from_the_cache():
    device = get_device("cuda")
    torch.cuda.empty_cache()
    # One 64 MiB segment carved into 4 x 12 MiB + a 16 MiB tail; freeing the second leaves a 12 MiB
    # hole between live blocks: 28 MiB cached, no whole free segment, no block over 16 MiB.
    torch.empty(64 * MiB, dtype=torch.uint8, device=device.device)
    held = [torch.empty(12 * MiB, dtype=torch.uint8, device=device.device) for _ in range(4)]
    del held[1]
    room = device.headroom(min_block=12 * MiB)
    assert 12 * MiB in room.usable_blocks and 16 * MiB in room.usable_blocks, room.explain()
    assert device.headroom(min_block=14 * MiB).usable_blocks.count(12 * MiB) == 0, "the hole is too small for 14 MiB"
    largest = room.largest_cached_block
    reserved = torch.cuda.memory_reserved(device.device)
    extra = torch.empty(largest, dtype=torch.uint8, device=device.device)
    assert torch.cuda.memory_reserved(device.device) == reserved, "the largest block counted was not served from the cache"
    del extra, held
    torch.cuda.empty_cache()
