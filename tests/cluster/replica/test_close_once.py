"""A replica's memory closes once: a second close (a stage deployment's ``__del__`` when the object is
collected, at any later moment) never releases leases a later replica of the same name took since."""
from __future__ import annotations

from cluster.replica.ledger_view import ReplicaMemory

OWNER = "local-close-once"


def test_a_second_close_leaves_a_later_replicas_leases_alone():
    first = ReplicaMemory.open_local(OWNER)
    assert first.host_budget.request(1000, OWNER)
    assert first.close() == 1000
    later = ReplicaMemory.open_local(OWNER)  # the next test's replica: same stage, same name, same ledger
    lease = later.host_budget.request(2000, OWNER)
    assert lease
    try:
        assert first.close() == 0  # collected long after: nothing of its own is left
        assert lease in later.host_budget.outstanding(OWNER), "the later replica's lease was released"
    finally:
        assert later.close() == 2000
