"""The ingress's watch: nothing is refused on a down reading that began before the request came (reads shared
and spaced under a flood); a slow older read never replaces a newer one; pending counts."""
from __future__ import annotations

import asyncio
import threading
import time

import pytest

from deployments.api.serving import ServingState, StageDown
from deployments.capacity.gpu_shares import PendingReplica
from deployments.ingress import watch

DOWN = ServingState((StageDown("Denoiser", "UPDATING", ""),))


@pytest.fixture(autouse=True)
def no_controller(monkeypatch):
    """Serve's details as the watch's tests fake them: the reading is faked further down (serving_state)."""
    monkeypatch.setattr(watch.unplaced, "serve_details", lambda: {})


def _replica(replica_id: str, state: str, node_id: str | None = "n1") -> dict:
    return {"replica_id": replica_id, "state": state, "node_id": node_id, "actor_name": f"SERVE_REPLICA::{replica_id}",
            "start_time_s": 1.0}


def _details(**deployments) -> dict:
    """Serve's details of one app, "app", as the controller sends them (plain JSON, the REST API's shape)."""
    return {"applications": {"app": {"name": "app", "status": "DEPLOYING", "message": "app deploying",
                                     "deployments": {name: {"name": name, **d} for name, d in deployments.items()}}}}


def test_the_fields_read_from_serves_details_are_its_schemas():
    from ray.serve.schema import ApplicationDetails, DeploymentDetails, ReplicaDetails

    app = _details(Denoiser={"status": "HEALTHY", "message": "", "replicas": [_replica("d1", "RUNNING")]}
                   )["applications"]["app"]
    assert set(app) <= set(ApplicationDetails.model_fields)
    assert set(app["deployments"]["Denoiser"]) <= set(DeploymentDetails.model_fields)
    assert set(app["deployments"]["Denoiser"]["replicas"][0]) <= set(ReplicaDetails.model_fields)


def test_a_status_the_controller_sends_as_serves_enum_reads_as_its_name():
    # get_serve_details() dumps its models without mode="json": statuses arrive as DeploymentStatus members,
    # whose str() is "DeploymentStatus.DEPLOY_FAILED", and the API's "failed to deploy" reads the name.
    from ray.serve._private.common import DeploymentStatus

    details = _details(Denoiser={"status": DeploymentStatus.DEPLOY_FAILED, "message": "ctor failed", "replicas": []})
    (denoiser,) = watch.serving_state("app", ("Denoiser",), details).down
    assert denoiser.status == "DEPLOY_FAILED"


def test_serving_state_is_read_from_serves_details_without_serve_status(monkeypatch):
    from ray import serve

    monkeypatch.setattr(serve, "status", lambda: pytest.fail("serve.status() validates every app into models"))
    long = "RuntimeError: " + "x" * 1000
    details = _details(TextEncoder={"status": "HEALTHY", "message": "", "replicas": [_replica("t1", "RUNNING")]},
                       Denoiser={"status": "UNHEALTHY", "message": long,
                                 "replicas": [_replica("d1", "STARTING", None), _replica("d0", "STOPPING")]})
    state = watch.serving_state("app", details=details)
    assert state.down == (
        StageDown("Denoiser", "UNHEALTHY", long[:watch.REASON_CHARS] + " ..."),
        StageDown("VaeDecoder", "MISSING", "app deploying"),
    )
    gone = watch.serving_state("other", details=details)
    assert [d.status for d in gone.down] == ["MISSING"] * 3 and "'other'" in gone.down[0].reason
    assert watch.serving_state("app", ("TextEncoder",), details).serving


def test_no_pending_replica_is_found_without_the_schemas_models_or_the_gcs(monkeypatch):
    from ray.serve import schema

    monkeypatch.setattr(schema.ApplicationDetails, "model_validate", lambda raw: pytest.fail("validated"))
    monkeypatch.setattr(watch.unplaced, "gpu_nodes", lambda free=False: pytest.fail("read the GCS's nodes"))
    details = _details(Denoiser={"status": "HEALTHY", "message": "",
                                 "replicas": [_replica("d1", "RUNNING"),
                                              {**_replica("d2", "STARTING"), "start_time_s": time.time()}]})
    assert watch.unplaced.pending_replicas("app", details=details) == ()
    assert watch.unplaced.pending_replicas("other", details=details) == ()


def test_each_read_asks_the_controller_once_for_the_stages_and_the_pending_count(monkeypatch):
    details = _details(**{name: {"status": "HEALTHY", "message": "", "replicas": [_replica(name, "RUNNING")]}
                          for name in watch.STAGES})
    asked = []
    monkeypatch.setattr(watch.unplaced, "serve_details", lambda: asked.append(1) or details)
    monkeypatch.setattr(watch, "PendingGauge", Gauge)
    app_watch = watch.AppWatch("app", interval_s=3600)
    try:
        wait_for(lambda: app_watch._gauge.counts)
        assert app_watch.state().serving
        assert app_watch._gauge.counts == [{"TextEncoder": 0, "Denoiser": 0, "VaeDecoder": 0}]
        assert len(asked) == 1, "the pending count read Serve's details again"
    finally:
        app_watch.close()


class Gauge:
    def __init__(self):
        self.counts = []

    def record(self, counts):
        self.counts.append(counts)


def test_a_stale_down_reading_is_read_again_before_a_refusal_and_pending_replicas_are_counted(monkeypatch):
    readings = [DOWN]
    monkeypatch.setattr(watch, "serving_state", lambda app, stages, details: readings[-1])
    monkeypatch.setattr(watch, "PendingGauge", Gauge)
    pending = PendingReplica("Denoiser", "r1", (("GPU", 0.6),), 3.0, "no node has 0.6 GPU free")
    monkeypatch.setattr(watch.unplaced, "pending_replicas", lambda app, details: (pending,))
    app_watch = watch.AppWatch("app", interval_s=3600)  # one reading at start, then none on its own
    try:
        for _ in range(200):
            if app_watch.state().known:
                break
            asyncio.run(asyncio.sleep(0.01))
        assert app_watch.state() == DOWN
        # The reading sets the state, then records the pending count: under load the test got between them.
        wait_for(lambda: app_watch._gauge.counts)
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

    def __call__(self, app, stages, details):
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
    monkeypatch.setattr(watch.unplaced, "pending_replicas", lambda app, details: ())
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
    monkeypatch.setattr(watch.unplaced, "pending_replicas", lambda app, details: ())
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
    monkeypatch.setattr(watch.unplaced, "pending_replicas", lambda app, details: ())
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
