"""The ingress's watch over its application: which stage deployments run, and how many replicas wait.

Every ``WATCH_INTERVAL_S`` a thread of the ingress replica reads Serve's details of the apps (one call to
the controller, read as plain dicts: ``capacity.unplaced.serve_details``) and keeps a
:class:`deployments.api.serving.ServingState` the API answers from without a round trip per request (a
refusal on a "down" reading waits for one that began after the request came: ``AppWatch.confirm``); every
``PENDING_EVERY`` reads it also counts, from the same reply, the stage replicas Ray has not placed
(``capacity.unplaced``; the GCS only when one waits) for the ``offload_serve_pending_replicas`` gauge.
A stage is down while it has no RUNNING replica; its status and Serve's message say why (deploying,
unhealthy, failed to deploy). A change is logged once.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import Counter
from typing import Mapping

from deployments.api.serving import ServingState, StageDown
from deployments.capacity import unplaced
from deployments.replica.metrics import PendingGauge

logger = logging.getLogger(__name__)

STAGES = ("TextEncoder", "Denoiser", "VaeDecoder")
# Serve's message for a failed deployment ends in the constructor's traceback: the start of it says
# what failed; the rest is in Serve's controller log.
REASON_CHARS = 600
# 2 s: a stage that fails is refused for within 2 s of Serve knowing; one status read costs the
# controller ~1 ms, so the ingress's replicas add < 1 call/s to it.
WATCH_INTERVAL_S = 2.0
PENDING_EVERY = 5
# A "down" reading is read afresh before the API refuses on it unless the reading began after the
# request came: the app may have come up since (a request right after serve.run returned got a 503
# from a reading 2 s old, and once from one taken 0.1 s before the app turned RUNNING). Reads for
# refusals start at least this far apart, and every request waiting meanwhile shares the next one,
# so a flood while a stage is down costs the controller <= 4 reads/s per ingress replica and a
# refusal at most 0.25 s. Unplaced replicas every 10 s: it also reads the GCS's placement groups and nodes.
CONFIRM_AFTER_S = 0.25


def _value(status) -> str:
    """A status as its name: the controller's reply holds Serve's enums, not their JSON strings."""
    return str(getattr(status, "value", status))


def serving_state(app_name: str, stages=STAGES, details: Mapping | None = None) -> ServingState:
    """The app's stages as Serve reports them now (from a replica or a driver); ``details``: a
    :func:`deployments.capacity.unplaced.serve_details` reply already read."""
    details = unplaced.serve_details() if details is None else details
    app = details.get("applications", {}).get(app_name)
    if app is None:
        return ServingState(tuple(StageDown(s, "MISSING", f"Serve has no application {app_name!r}") for s in stages))
    down = []
    for stage in stages:
        info = app.get("deployments", {}).get(stage)
        if info is None:
            down.append(StageDown(stage, "MISSING", app.get("message") or ""))
            continue
        if not any(replica.get("state") == "RUNNING" for replica in info.get("replicas", ())):
            message = info.get("message") or ""
            reason = message if len(message) <= REASON_CHARS else message[:REASON_CHARS] + " ..."
            down.append(StageDown(stage, _value(info.get("status")), reason))
    return ServingState(tuple(down))


class AppWatch:
    """``state()`` is the last reading (``known=False`` before the first); ``close()`` stops the thread."""

    def __init__(self, app_name: str, interval_s: float = WATCH_INTERVAL_S, stages=STAGES):
        self.app_name, self.interval_s, self.stages = app_name, interval_s, stages
        self._state = ServingState(known=False)
        self._state_from = float("-inf")  # time.monotonic() when the read that gave _state began
        self._tried_at = float("-inf")  # when the last read began
        self._settled_from = float("-inf")  # when the last read to end (read or unreadable) began
        self._swap = threading.Lock()  # the thread's read and a confirming read may end in either order
        self._confirming = asyncio.Lock()
        self._gauge = PendingGauge()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="app-watch", daemon=True)
        self._thread.start()

    def state(self) -> ServingState:
        return self._state

    async def confirm(self) -> ServingState:
        """The last reading if it says the app serves; else one that began after this call did (off the
        event loop, shared by the calls waiting for it, at most one per CONFIRM_AFTER_S), so nothing
        is refused on a reading the app may have outgrown before the request came."""
        asked = time.monotonic()
        if self._state.serving:
            return self._state
        async with self._confirming:
            wait = self._tried_at + CONFIRM_AFTER_S - time.monotonic()
            if self._settled_from < asked and wait > 0:
                await asyncio.sleep(wait)
            if self._settled_from < asked:  # no read that began since the request came has ended
                await asyncio.to_thread(self._read, False)
        return self._state

    def _run(self) -> None:
        reads = 0
        while not self._stop.is_set():
            self._read(count_pending=reads % PENDING_EVERY == 0)
            reads += 1
            self._stop.wait(self.interval_s)

    def _read(self, count_pending: bool) -> None:
        began = self._tried_at = time.monotonic()
        try:
            details = unplaced.serve_details()  # one controller call for the stages and the pending count
            state = serving_state(self.app_name, self.stages, details)
        except Exception as exc:  # the controller restarting: keep the last reading, say so once per change
            logger.info("app watch: Serve's status unreadable (%s: %s); keeping the last reading",
                        type(exc).__name__, exc)
            with self._swap:
                self._settled_from = max(self._settled_from, began)
            return
        with self._swap:
            if began > self._state_from:  # a read that began later and ended first is the truer one
                if state != self._state:
                    logger.info("app watch: %s", state.describe())
                self._state, self._state_from = state, began
            self._settled_from = max(self._settled_from, began)
        if count_pending:
            try:
                pending = unplaced.pending_replicas(self.app_name, details=details)
            except Exception as exc:
                logger.info("app watch: pending replicas unreadable (%s: %s)", type(exc).__name__, exc)
                return
            counts = Counter(p.deployment for p in pending)
            self._gauge.record({stage: counts.get(stage, 0) for stage in self.stages})

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=self.interval_s + 1)
