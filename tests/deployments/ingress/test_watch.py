"""The ingress's watch: nothing is refused on a down reading that began before the request came (reads shared
and spaced under a flood); a slow older read never replaces a newer one; pending counts."""
from __future__ import annotations

import asyncio
import threading
import time

from deployments.api.serving import ServingState, StageDown
from deployments.capacity.gpu_shares import PendingReplica
from deployments.ingress import watch

DOWN = ServingState((StageDown("Denoiser", "UPDATING", ""),))


class Gauge:
    def __init__(self):
        self.counts = []

    def record(self, counts):
        self.counts.append(counts)


def test_a_stale_down_reading_is_read_again_before_a_refusal_and_pending_replicas_are_counted(monkeypatch):
    readings = [DOWN]
    monkeypatch.setattr(watch, "serving_state", lambda app, stages: readings[-1])
    monkeypatch.setattr(watch, "PendingGauge", Gauge)
    pending = PendingReplica("Denoiser", "r1", (("GPU", 0.6),), 3.0, "no node has 0.6 GPU free")
    monkeypatch.setattr(watch.unplaced, "pending_replicas", lambda app: (pending,))
    app_watch = watch.AppWatch("app", interval_s=3600)  # one reading at start, then none on its own
    try:
        for _ in range(200):
            if app_watch.state().known:
                break
            asyncio.run(asyncio.sleep(0.01))
        assert app_watch.state() == DOWN
        assert app_watch._gauge.counts == [{"TextEncoder": 0, "Denoiser": 1, "VaeDecoder": 0}]
        readings.append(ServingState())  # the app came up after the last reading
        asyncio.run(asyncio.sleep(watch.CONFIRM_AFTER_S))
        assert asyncio.run(app_watch.confirm()).serving, "a refusal would have been decided on a stale reading"
        assert app_watch.state().serving
    finally:
        app_watch.close()


class SlowStatus:
    """Serve's status as the watch reads it: the app's state when a read begins, answered when the
    test lets that read end (``release``); reads after the first end at once."""

    def __init__(self):
        self.now, self.began = DOWN, []
        self.release = threading.Event()

    def __call__(self, app, stages):
        seen = self.now
        self.began.append(time.monotonic())
        if len(self.began) == 1:
            self.release.wait(10)
        return seen


def wait_for(predicate):
    deadline = time.monotonic() + 10
    while not predicate():
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_a_request_right_after_the_app_came_up_is_not_refused_on_a_reading_that_began_before(monkeypatch):
    # The flake this pins: serve.run returned (the app RUNNING), the first request got "stage
    # TextEncoder is not running (deploying)" from the watch's reading taken just before.
    status = SlowStatus()
    monkeypatch.setattr(watch, "serving_state", status)
    monkeypatch.setattr(watch, "PendingGauge", Gauge)
    monkeypatch.setattr(watch.unplaced, "pending_replicas", lambda app: ())
    monkeypatch.setattr(watch, "CONFIRM_AFTER_S", 1.0)  # wide, so the reading is "recent" however slow the test
    app_watch = watch.AppWatch("app", interval_s=3600)
    try:
        wait_for(lambda: status.began)  # the thread's read has seen the stages deploying
        status.now = ServingState()  # ... the app turns RUNNING, and the read ends
        status.release.set()
        wait_for(lambda: app_watch.state().known)
        assert app_watch.state() == DOWN
        assert asyncio.run(app_watch.confirm()).serving, "refused on a reading older than the request"
        assert len(status.began) == 2
    finally:
        app_watch.close()


def test_a_read_that_ends_after_a_newer_one_does_not_overwrite_it(monkeypatch):
    status = SlowStatus()
    monkeypatch.setattr(watch, "serving_state", status)
    monkeypatch.setattr(watch, "PendingGauge", Gauge)
    monkeypatch.setattr(watch.unplaced, "pending_replicas", lambda app: ())
    monkeypatch.setattr(watch, "CONFIRM_AFTER_S", 0.0)
    app_watch = watch.AppWatch("app", interval_s=3600)
    try:
        wait_for(lambda: status.began)  # the thread's read sees the app down and is slow to answer
        status.now = ServingState()
        assert asyncio.run(app_watch.confirm()).serving  # a request's read begins later and ends first
        status.release.set()
        app_watch.close()  # the thread's read has ended
        assert app_watch.state().serving, "the older reading replaced the newer one"
    finally:
        app_watch.close()


def test_a_flood_of_requests_while_a_stage_is_down_shares_reads_at_most_one_per_confirm_period(monkeypatch):
    status = SlowStatus()
    status.release.set()
    monkeypatch.setattr(watch, "serving_state", status)
    monkeypatch.setattr(watch, "PendingGauge", Gauge)
    monkeypatch.setattr(watch.unplaced, "pending_replicas", lambda app: ())
    app_watch = watch.AppWatch("app", interval_s=3600)
    try:
        wait_for(lambda: app_watch.state().known)

        async def flood():
            states = []
            for _ in range(10):  # 10 waves of 20 requests, 0.05 s apart: 0.5 s of refusals
                states += await asyncio.gather(*(app_watch.confirm() for _ in range(20)))
                await asyncio.sleep(0.05)
            return states

        started = time.monotonic()
        states = asyncio.run(flood())
        took = time.monotonic() - started
        assert all(s == DOWN for s in states) and len(states) == 200
        reads = [t for t in status.began if t >= started]
        assert len(reads) <= took / watch.CONFIRM_AFTER_S + 1, (len(reads), took)
        assert all(b - a >= watch.CONFIRM_AFTER_S for a, b in zip(status.began, status.began[1:]))
    finally:
        app_watch.close()
