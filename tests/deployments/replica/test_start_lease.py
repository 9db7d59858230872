"""A starting replica whose node ledger refuses its standing lease waits and asks again (it stays
STARTING, listed as pending), instead of failing its start into Serve's restart loop."""
from __future__ import annotations

import logging

import pytest

from cluster.replica.device_leases import LeaseKind, LeaseRefused
from deployments.replica import leases
from deployments.replica.leases import NeverPlaceable, hold_standing_at_start
from offload_core.host.budget import Refusal

GB = 10**9


class BusyGpu:
    """Device leases whose ledger refuses the standing lease ``refusals`` times (neighbours' calls hold it)."""

    def __init__(self, refusals: int):
        self.refusals, self.asked = refusals, []

    def hold_standing(self, nbytes: int, timeout_s: float):
        self.asked.append((nbytes, timeout_s))
        if len(self.asked) <= self.refusals:
            raise LeaseRefused(LeaseKind.STANDING, nbytes, Refusal("d#1", nbytes, GB, "neighbours hold 23 GB"),
                               timeout_s)
        return object()


def test_a_refused_standing_lease_at_start_is_asked_for_again_until_granted(caplog):
    gpu = BusyGpu(refusals=2)
    with caplog.at_level(logging.INFO, logger=leases.logger.name):
        assert hold_standing_at_start(gpu, 5 * GB, 30.0, 24 * GB, "d#1") == 2
    assert gpu.asked == [(5 * GB, 30.0)] * 3  # each attempt waits the device timeout inside the ledger
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 3 and "refused (neighbours hold 23 GB)" in lines[0] and "granted after" in lines[-1]


def test_a_standing_lease_larger_than_the_whole_gpu_pool_fails_the_start_at_once():
    gpu = BusyGpu(refusals=0)
    with pytest.raises(NeverPlaceable, match="more than the"):
        hold_standing_at_start(gpu, 25 * GB, 30.0, 24 * GB, "d#1")
    assert gpu.asked == []
