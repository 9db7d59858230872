"""The link measurement: a typed refusal off CUDA; on CUDA it gives back all it took and runs once."""
from __future__ import annotations

import logging

import pytest
import torch

from offload_core.planner.facts import LinkFacts
from offload_core.streaming import link
from offload_core.streaming.fill_threads import FillProbe
from offload_core.streaming.link import measure_link


def test_the_link_is_measured_on_cuda_only_and_says_so():
    with pytest.raises(ValueError, match="measured on CUDA, not cpu; configure LinkFacts"):
        measure_link("cpu")


def test_the_staged_rate_is_never_priced_above_the_fill_probes_memcpy_out_of_uncached_memory(caplog):
    """The staged probe copies one source again and again, a cache can hold part of it: a fill's memcpy
    (the fill probe's, out of slices no cache holds) bounds what the plan prices staged tiers at."""
    fills = FillProbe(threads=4, rates_Bps=(5.0e9, 10.0e9, 18.5e9, 20.0e9))
    with caplog.at_level(logging.INFO, logger="offload_core.streaming.link"):
        assert link.staged_rate("cuda:0", 31.0e9, fills) == 20.0e9
    assert "staged probe 31.0 GB/s is above the host memcpy out of uncached memory (20.0 GB/s" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="offload_core.streaming.link"):
        assert link.staged_rate("cuda:0", 17.0e9, fills) == 17.0e9, "below the memcpy: the probe's own figure"
    assert caplog.text == "", "nothing capped, nothing said"


# torch's pinned pool may grow by a few small blocks of its own while the probe runs: on the H200 it
# owned 35,328 B more afterwards (32 KiB + 2 KiB + 512 B, its power-of-two blocks), none checked
# out. The probe's own buffers are 32-256 MiB: one cached there would be >= 32 MiB.
POOL_GROWTH_ALLOWED = 1 << 20


def _held(device: torch.device) -> tuple[int, int, int]:
    """Device bytes reserved and allocated, pinned bytes checked out of torch's pool."""
    host = torch.cuda.host_memory_stats()
    return torch.cuda.memory_reserved(device), torch.cuda.memory_allocated(device), host.get("active_bytes.current", 0)


def _pool_bytes() -> int:
    """Pinned bytes torch's pool owns, checked out or cached."""
    return torch.cuda.host_memory_stats().get("allocated_bytes.current", 0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="host->device bandwidth needs a CUDA device")
def test_cuda_measuring_the_link_gives_back_device_and_pinned_memory_and_runs_once_per_process():
    device = torch.device("cuda", torch.cuda.current_device())
    torch.cuda.empty_cache()
    link._MEASURED.clear()
    before, pool_before = _held(device), _pool_bytes()
    facts = measure_link(device, nbytes=64 * 1024 * 1024)
    assert isinstance(facts, LinkFacts) and facts.measured
    assert facts.pinned_Bps > 1e9 and facts.pageable_Bps > 1e8 and facts.staged_Bps > 1e8
    # Staging pipelines a memcpy with the DMA: never faster than the DMA alone.
    assert facts.staged_Bps <= 1.1 * facts.pinned_Bps
    assert _held(device) == before, "the probe's device or pinned host memory is still held"
    grown = _pool_bytes() - pool_before
    assert grown < POOL_GROWTH_ALLOWED, f"torch's pinned pool keeps {grown} B more: a probe buffer cached there"
    assert measure_link(device, nbytes=64 * 1024 * 1024) is facts, "a second replica stage re-measured"
