"""A stage replica whose prefetch could not get room beside a neighbour's lease answers busy (503)."""
from __future__ import annotations

import pytest

from cluster.replica.ledger_view import DeviceBusy
from deployments.models import families
from deployments.wire.spec import PipelineStage
from offload_core.streaming.headroom import Headroom, HeadroomTimeout
from zoo import tiny


def test_a_prefetch_that_timed_out_beside_a_neighbours_lease_is_device_busy_with_the_numbers():
    from deployments.app import stage_configs
    from deployments.replica.worker import StageWorker
    from tests.deployments.conftest import tiny_args

    facts = families.read_family_traits(tiny.ensure_tiny_wan())
    worker = StageWorker(stage_configs(tiny_args(), facts)[PipelineStage.DECODE])
    try:
        calls = worker.leases.figures().calls  # calibration's
        room = Headroom(4096, driver_free=10_000, neighbours_outstanding=9_000)
        with pytest.raises(DeviceBusy) as busy:
            with worker._call_lease(0):
                raise HeadroomTimeout("prefetch ring", 8192, 2.5, room)
        assert busy.value.nbytes == 8192 and busy.value.available == 1000 and busy.value.retry_after_s == 3
        assert "neighbours' outstanding leases 9000 B" in str(busy.value)
        assert worker.leases.figures().calls == calls + 1 and not worker.busy, "the call ended with the error"
    finally:
        worker.close()
