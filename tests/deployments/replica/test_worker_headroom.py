"""A stage replica whose prefetch could not get room beside a neighbour's lease answers busy (503); a replica
is busy while a call holds it, not while a report is built."""
from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest

from cluster.replica.ledger_view import DeviceBusy
from deployments.models import families
from deployments.wire.spec import PipelineStage
from offload_core.streaming.headroom import Headroom, HeadroomTimeout
from zoo import tiny


@pytest.fixture(scope="module")
def worker():
    from deployments.app import stage_configs
    from deployments.replica.worker import StageWorker
    from tests.deployments.conftest import tiny_args

    facts = families.read_family_traits(tiny.ensure_tiny_wan())
    worker = StageWorker(stage_configs(tiny_args(), facts)[PipelineStage.DECODE])
    yield worker
    worker.close()


def test_a_prefetch_that_timed_out_beside_a_neighbours_lease_is_device_busy_with_the_numbers(worker):
    calls = worker.leases.figures().calls  # calibration's
    room = Headroom(4096, driver_free=10_000, neighbours_outstanding=9_000)
    with pytest.raises(DeviceBusy) as busy:
        with worker._call_lease(0):
            raise HeadroomTimeout("prefetch ring", 8192, 2.5, room)
    assert busy.value.nbytes == 8192 and busy.value.available == 1000 and busy.value.retry_after_s == 3
    assert "neighbours' outstanding leases 9000 B" in str(busy.value)
    # The call ended with the error: the next call's lease is taken at once (a held one would block it).
    taken = threading.Event()

    def next_call():
        with worker._call_lease(0):
            taken.set()
    threading.Thread(target=next_call, daemon=True).start()
    assert taken.wait(10), "the failed call kept its lease"
    assert worker.leases.figures().calls == calls + 2


def test_a_replica_is_busy_while_a_call_holds_it_not_while_a_report_is_built(worker, monkeypatch):
    """A report takes the call lock for 2.5-17 ms every second after calls (it walks the weights): read as
    busy, it made a replica that had finished its call look held (a flaky clean-clone run, 2026-12-07)."""
    from deployments.replica import worker as worker_module

    during_report = []
    build = worker.report
    monkeypatch.setattr(worker, "report", lambda: (during_report.append(worker.busy), build())[1])
    monkeypatch.setattr(worker_module.ray, "is_initialized", lambda: True)  # publish builds only under Ray
    monkeypatch.setattr(worker, "_board", SimpleNamespace(publish=SimpleNamespace(remote=lambda *a: None)))
    worker.publish()
    # The replica's own publisher thread may build a report too while Ray reads as up: each one counts.
    assert during_report and not any(during_report), during_report
    with worker.in_use():
        assert worker.busy
    assert not worker.busy
