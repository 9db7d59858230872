"""Throttled sends: at most one per interval, off the caller's thread, always the latest state."""
from __future__ import annotations

import threading
import time

from deployments.replica.board_publisher import Throttled


def test_pokes_within_an_interval_fold_into_one_send_that_reads_the_latest_state():
    state, sent, done = {"size": 0}, [], threading.Event()

    def send():
        sent.append((state["size"], threading.current_thread().name))
        done.set()

    throttled = Throttled(send, 0.2, "batch-test")
    try:
        throttled.poke()  # the first send goes at once; wait for it
        assert done.wait(5)
        done.clear()
        for size in (1, 2, 3):  # within the interval: one more send, with the last size
            state["size"] = size
            throttled.poke()
        assert done.wait(5)
        time.sleep(0.3)
    finally:
        throttled.close()
    assert [size for size, _ in sent] == [0, 3]
    assert all(name.startswith("batch-test") for _, name in sent), "sent on the caller's thread"


def test_a_poke_does_not_wait_for_a_slow_send_and_close_waits_for_the_pending_one():
    release, sent = threading.Event(), []

    def send():
        release.wait(5)
        sent.append(True)

    throttled = Throttled(send, 0.01, "slow-test")
    start = time.monotonic()
    throttled.poke()
    throttled.poke()
    # A poke that waited would take the send's 5 s; half of it leaves room for a preempted worker.
    assert time.monotonic() - start < 2.5, "poke blocked on the send"
    release.set()
    throttled.close()
    # The second poke folded into the first send, or (had that send begun) made one more: never lost.
    assert 1 <= len(sent) <= 2


def test_with_a_keepalive_the_state_is_sent_again_without_a_change_until_closed():
    """A board that restarted empty learns an idle replica's report again within the keep-alive."""
    sent = []
    throttled = Throttled(lambda: sent.append(time.monotonic()), 0.01, "keepalive-test", sent_now=True,
                          keepalive_s=0.1)
    time.sleep(0.55)
    throttled.close()
    count = len(sent)
    time.sleep(0.2)
    assert 3 <= count <= 6, f"{count} sends in 0.55 s with a 0.1 s keep-alive"
    assert len(sent) == count, "sent after close"


def test_with_a_settle_the_send_waits_that_long_after_the_poke_and_later_pokes_fold_into_it():
    """A stage call pokes just before its answer leaves: the report must not be built alongside it."""
    sent = []
    throttled = Throttled(lambda: sent.append(time.monotonic()), 0.05, "settle-test", settle_s=0.3)
    try:
        poked_at = time.monotonic()
        throttled.poke()
        time.sleep(0.1)
        throttled.poke()
        assert sent == [], "sent before the settle"
        time.sleep(0.5)
    finally:
        throttled.close()
    assert len(sent) == 1 and sent[0] - poked_at >= 0.3
