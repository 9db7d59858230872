"""Staging fills split over the copier's threads: every byte once, bitwise equal, wired from the link to the engine."""
from __future__ import annotations

import threading

import pytest
import torch

from offload_core.host.tier import HostingTier
from offload_core.planner.facts import LinkFacts, PipelineFacts, Stage, profile_component
from offload_core.planner.search import PerformanceMode, plan_pipeline
from offload_core.quant import WeightFormat
from offload_core.residency.components import streaming_config
from offload_core.streaming import copier, fill_threads
from offload_core.streaming.copier import FillSplitter, InlineCopier, ThreadCopier, split_pairs
from offload_core.streaming.device import Device, DeviceCapacity
from offload_core.streaming.engine import StreamingConfig, apply_layer_streaming
from offload_core.streaming.fill_threads import default_cap, probe
from tests.offload_core.streaming.test_fp8 import _reference
from tests.offload_core.streaming.test_staging import _keys
from tests.offload_core.tiny_models import ALL_CASES, WAN


def _pairs(sizes_dtypes):
    """(dst, src) pairs of the given element counts and dtypes, src random, dst zero."""
    g = torch.Generator().manual_seed(0)
    return [(torch.zeros(n, dtype=dtype), torch.randint(0, 100, (n,), generator=g).to(dtype))
            for n, dtype in sizes_dtypes]


@pytest.mark.parametrize("shares", [1, 2, 3, 4, 7])
def test_split_pairs_cover_every_byte_once_at_aligned_cuts(shares):
    # 10,007 bytes, 333 float32 and 7 bf16: no total divisible by the share count
    pairs = _pairs([(10_007, torch.uint8), (333, torch.float32), (7, torch.bfloat16)])
    parts = split_pairs(pairs, shares)
    assert 1 <= len(parts) <= shares
    for dst, src in pairs:
        covered = [0] * dst.numel()
        for part in parts:
            for d, s in part:
                if d.untyped_storage().data_ptr() != dst.untyped_storage().data_ptr():
                    continue
                start = (d.data_ptr() - dst.data_ptr()) // dst.element_size()
                assert (d.data_ptr() - dst.data_ptr()) % copier.SPLIT_ALIGN == 0, "a cut falls on an aligned byte"
                assert s.data_ptr() - src.data_ptr() == d.data_ptr() - dst.data_ptr(), "src and dst cut alike"
                for i in range(start, start + d.numel()):
                    covered[i] += 1
        assert covered == [1] * dst.numel()
    total = sum(d.numel() * d.element_size() for d, _ in pairs)
    sizes = [sum(d.numel() * d.element_size() for d, _ in part) for part in parts]
    assert max(sizes) <= -(-total // shares) + shares * copier.SPLIT_ALIGN, sizes  # each cut rounds down


def test_split_pairs_refuses_what_it_cannot_cut():
    with pytest.raises(ValueError, match="1-D"):
        split_pairs([(torch.zeros(2, 2), torch.zeros(2, 2))], 2)
    with pytest.raises(ValueError, match="shares"):
        split_pairs([], 0)


def _recording(monkeypatch) -> list[str]:
    """The names of the threads that ran each share of a split copy."""
    seen, copy = [], copier.copy_pairs

    def record(pairs):
        seen.append(threading.current_thread().name)
        return copy(pairs)
    monkeypatch.setattr(copier, "copy_pairs", record)
    return seen


def test_a_split_fill_of_a_size_the_threads_do_not_divide_is_bitwise_and_uses_every_thread(monkeypatch):
    monkeypatch.setattr(copier, "MIN_SHARE_BYTES", 64)
    seen = _recording(monkeypatch)
    pairs = _pairs([(100_003, torch.uint8), (1_001, torch.bfloat16)])
    splitter = FillSplitter(3, "t")
    try:
        assert splitter.copy(pairs) == 100_003 + 2 * 1_001
    finally:
        splitter.close()
    for dst, src in pairs:
        assert torch.equal(dst, src)
    # three shares, the caller's and two on helpers (a quick helper may take both: the pool reuses it)
    assert len(seen) == 3 and seen.count(threading.current_thread().name) == 1, seen


def test_small_fills_are_not_split(monkeypatch):
    seen = _recording(monkeypatch)
    splitter = FillSplitter(4, "t")
    try:
        splitter.copy(_pairs([(1000, torch.uint8)]))  # far under MIN_SHARE_BYTES: one share, the caller's
    finally:
        splitter.close()
    assert seen == [threading.current_thread().name]


def test_a_helper_share_that_raises_fails_the_fill_after_every_share_ended(monkeypatch):
    monkeypatch.setattr(copier, "MIN_SHARE_BYTES", 64)
    copy, ended = copier.copy_pairs, []

    def failing(pairs):
        if threading.current_thread().name.startswith("t-split"):
            ended.append(1)
            raise OSError("EIO in a helper")
        copy(pairs)
        ended.append(1)
        return 0
    monkeypatch.setattr(copier, "copy_pairs", failing)
    splitter = FillSplitter(3, "t")
    try:
        with pytest.raises(OSError, match="EIO"):
            splitter.copy(_pairs([(30_000, torch.uint8)]))
    finally:
        splitter.close()
    assert len(ended) == 3, "the fill returned before every share ended"


class SplitCpuDevice(Device):
    """CPU with a real copier thread (as on CUDA) whose fills split over the configured threads."""

    def __init__(self):
        super().__init__(torch.device("cpu"), DeviceCapacity())
        self.threads_asked: list[int | None] = []

    def host_copier(self, name: str, threads: int | None = None):
        self.threads_asked.append(threads)
        return ThreadCopier(name, threads or 1)


@pytest.mark.parametrize("weights", [WeightFormat.NATIVE, WeightFormat.FP8])
@pytest.mark.parametrize("case", ALL_CASES, ids=lambda c: c.name)
def test_streaming_with_split_fills_is_bitwise_equal_for_pageable_and_mapped_layers(case, weights, monkeypatch,
                                                                                     remove_after):
    monkeypatch.setattr(copier, "MIN_SHARE_BYTES", 64)  # the tiny layers' fills split too
    seen = _recording(monkeypatch)
    model, inputs = case.build(), case.inputs()
    expected = _reference(case, inputs) if weights is WeightFormat.FP8 else case.run(model, inputs)
    tiers = (HostingTier.PAGEABLE,) if weights is WeightFormat.FP8 else (HostingTier.PAGEABLE, HostingTier.MAPPED)
    hosting = {key: tiers[i % len(tiers)] for i, key in enumerate(_keys(model))}
    device = SplitCpuDevice()
    streamer = remove_after(apply_layer_streaming(model, device, StreamingConfig(
        hosting=hosting, copier_threads=3, weights=weights)))
    streamer.prepare_for_use()
    for _ in range(2):
        assert torch.equal(case.run(model, inputs), expected)
    streamer.finish_use()
    assert device.threads_asked == [3] and streamer.staging.copier_threads == 3
    assert {name.split("-split")[0] for name in seen if "-split" in name} == {"offload-staging"}, \
        "the fills' shares ran on the copier's helper threads"


def test_the_cpu_device_fills_on_one_thread_unless_told():
    device = Device(torch.device("cpu"), DeviceCapacity())
    assert device.host_copier("x").threads == 1
    assert device.host_copier("x", 2).threads == 2
    assert isinstance(device.host_copier("x"), InlineCopier)


def test_copier_threads_must_be_a_positive_count():
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="copier_threads"):
            StreamingConfig(copier_threads=bad)
    with pytest.raises(ValueError, match="copier_threads"):
        LinkFacts(25e9, 10e9, copier_threads=0)


def test_the_plan_runs_staged_fills_on_the_threads_the_link_priced_them_with():
    model = WAN.build()
    profile = profile_component("transformer", model, uses_per_request=2)
    link = LinkFacts(25e9, 8e9, measured=True, staged_Bps=18e9, copier_threads=3, host_memcpy_Bps=19e9)
    facts = PipelineFacts((profile,), (Stage("denoise", ("transformer",)),), device_capacity=10**12, link=link,
                          host_lease_bytes=0)  # nothing may be pinned: every streamed layer is staged
    plan = plan_pipeline(facts, PerformanceMode.MEMORY)
    component = plan.component("transformer")
    assert component.copier_threads == 3
    assert streaming_config(component).copier_threads == 3
    assert "staging fills split over 3 copier threads" in component.explain()
    assert "over 3 copier threads" in link.explain()


def test_the_cap_shares_the_cores_among_the_node_replicas():
    assert default_cap(1, cpus=16) == 8
    assert default_cap(1, cpus=4) == 4
    assert default_cap(8, cpus=16) == 2
    assert default_cap(32, cpus=16) == 1
    with pytest.raises(ValueError, match="replicas"):
        default_cap(0)


def test_the_probe_picks_the_fewest_threads_near_the_best_rate():
    found = probe(torch.empty(8 * 1024 * 1024, dtype=torch.uint8), cap=2, repeats=1)
    assert len(found.rates_Bps) == 2 and all(rate > 0 for rate in found.rates_Bps)
    assert found.rate_Bps >= 0.9 * max(found.rates_Bps)
    assert found.threads == 1 or found.rates_Bps[0] < 0.9 * max(found.rates_Bps)
    assert "copier threads" in found.explain()


def test_the_probe_never_reads_a_source_the_cache_could_hold(monkeypatch):
    """Each copy reads a slice that twice the cache's bytes went past since its last read: the rate
    is the fills' (a layer read once per step), not a cache's (the H200 host: 41.7 against 28.3 GB/s)."""
    reads: list[int] = []
    plain_copy = FillSplitter.copy

    def recorded(self, pairs):
        reads.extend(src.data_ptr() for _, src in pairs)
        return plain_copy(self, pairs)

    monkeypatch.setattr(FillSplitter, "copy", recorded)
    slice_bytes, cache_bytes = 1 << 20, 3 << 20
    found = probe(torch.empty(slice_bytes, dtype=torch.uint8), cap=3, repeats=2, cache_bytes=cache_bytes)
    assert len(reads) == 3 * (1 + 2)  # a warm-up and two timed copies per thread count
    assert found.source_bytes == fill_threads.source_slices(slice_bytes, cache_bytes) * slice_bytes
    last: dict[int, int] = {}
    for i, ptr in enumerate(reads):
        if ptr in last:
            assert (i - last[ptr] - 1) * slice_bytes >= 2 * cache_bytes, f"copy {i} read a source cached since {last[ptr]}"
        last[ptr] = i
    assert "last-level cache" in found.explain()


def test_the_slices_cover_twice_the_cache_within_bounds():
    MiB = 1 << 20
    assert fill_threads.source_slices(64 * MiB, 32 * MiB) == 2
    assert fill_threads.source_slices(64 * MiB, 105 * MiB) == 5  # (5 - 1) x 64 >= 210
    assert fill_threads.source_slices(64 * MiB, 384 * MiB) == 13
    assert fill_threads.source_slices(64 * MiB, 4096 * MiB) == fill_threads.MAX_SOURCE_SLICES


def test_where_sysfs_gives_no_cache_the_probe_rotates_over_the_most_slices(tmp_path):
    """gVisor (the H200 machines) has no cache folders in sysfs: 0 is "unknown", never "no cache", or two
    64 MiB slices would sit in a 105-384 MiB L3 and the probe would time a cache again."""
    MiB = 1 << 20
    assert fill_threads.last_level_cache_bytes({0, 1}, tmp_path / "absent") == 0
    assert fill_threads.source_slices(64 * MiB, 0) == fill_threads.MAX_SOURCE_SLICES
    found = probe(torch.empty(MiB, dtype=torch.uint8), cap=1, repeats=1, cache_bytes=0)
    assert found.source_bytes == fill_threads.MAX_SOURCE_SLICES * MiB
    assert "a last-level cache sysfs does not give (the most slices)" in found.explain()


def _cache(root, cpu, index, level, kind, size, shared):
    folder = root / f"cpu{cpu}" / "cache" / f"index{index}"
    folder.mkdir(parents=True)
    for name, value in (("level", level), ("type", kind), ("size", size), ("shared_cpu_list", shared)):
        (folder / name).write_text(f"{value}\n")


def test_the_last_level_cache_sums_the_top_level_instances_of_this_process_cores(tmp_path):
    for cpu in range(4):  # two core complexes of two cores: an L3 each, L1/L2 per core
        _cache(tmp_path, cpu, 0, 1, "Data", "32K", cpu)
        _cache(tmp_path, cpu, 1, 1, "Instruction", "32K", cpu)
        _cache(tmp_path, cpu, 2, 2, "Unified", "1024K", cpu)
        _cache(tmp_path, cpu, 3, 3, "Unified", "32768K", "0-1" if cpu < 2 else "2-3")
    MiB = 1 << 20
    assert fill_threads.last_level_cache_bytes({0, 1, 2, 3}, tmp_path) == 64 * MiB
    assert fill_threads.last_level_cache_bytes({0, 1}, tmp_path) == 32 * MiB
    assert fill_threads.last_level_cache_bytes({0, 1}, tmp_path / "absent") == 0
