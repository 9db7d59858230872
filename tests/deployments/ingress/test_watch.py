"""The ingress's watch: a down reading is confirmed afresh before anything is refused on it; pending counts."""
from __future__ import annotations

import asyncio

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
