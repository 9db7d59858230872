"""bench/staged_sweep.py's host side, on CPU: the memcpy out of a page-cached file mapping it measures."""
from __future__ import annotations

import torch

from bench.staged_sweep import mapped_copy_rates


def test_the_mapped_memcpy_rates_copy_the_files_bytes_by_each_thread_count():
    dst = torch.zeros(4 << 20, dtype=torch.uint8)
    rates = mapped_copy_rates(dst, [1, 2])
    assert set(rates) == {"1", "2"}
    assert all(r["first_GBps"] > 0 and r["warm_GBps"] > 0 for r in rates.values())
    assert bool((dst == 1).all()), "the copy read the file's bytes, not the anonymous warm-up's zeros"
