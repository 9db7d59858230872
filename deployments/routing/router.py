"""Serve's request router for the Denoiser: each request to the replica with the earliest predicted finish.

Ray builds one in every process holding a handle to the Denoiser (the ingress replicas, the
mixed-fleet bench's driver) from ``request_router_config.request_router_class``; ``build_app`` sets
it (``AppArgs.routing``). The decision is :func:`deployments.routing.choice.choose`; this class feeds
it the replicas' routing stats (:class:`deployments.capacity.replica_load.ReplicaLoad`) plus what it
sent each replica since those stats were taken, logs one line per routed request (decision and
prediction) and records predicted vs actual finish per GPU type (metrics, and
:mod:`deployments.routing.outcomes` for the bench, in this process: Serve ships this module by value,
so no state here is shared with the rest of the process).

Serve calls :meth:`choose_replicas` for one pending request (without Serve's FIFO mixin a replica
found for a request fulfils that request, so its prediction is the one logged); it probes the queue
length of each replica of a rank and skips full ones (``max_ongoing_requests``), so a full best
replica hands the request to the next rank.
"""
from __future__ import annotations

import collections
import logging
import time
from dataclasses import dataclass
from typing import Any

from ray.serve import metrics
from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from deployments.capacity.replica_load import QueuedWork, ReplicaLoad, Shape, StatsError
from deployments.routing import choice as decide
from deployments.routing import outcomes
from deployments.routing.choice import Candidate, Choice, Rule

logger = logging.getLogger(__name__)

# Serve's own default for request_routing_stats_period_s is 10 s; a 4-step image on an H100 takes
# ~1 s, so the app polls every second (build_app) and the bench every 0.5 s. Stale after two periods.
DEFAULT_STATS_PERIOD_S = 1.0
STALE_PERIODS = 2.0
# Finish-time buckets: 0.1 s (a tiny-zoo image) to 10 min (a 14B video queued behind others).
FINISH_BUCKETS_S = [0.1, 0.3, 1.0, 3.0, 10.0, 30.0, 100.0, 300.0, 600.0]
ERROR_BUCKETS = [0.05, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.0]
# Decisions waiting for their request to be routed; more means requests were cancelled unrouted.
CHOICES_KEPT = 10_000


@dataclass(frozen=True)
class _Sent:
    request_id: str
    work: QueuedWork
    sent_at_s: float
    gpu_type: str
    rule: Rule
    predicted_s: float | None


class _Metrics:
    def __init__(self):
        tags = ("gpu_type",)
        self.predicted = metrics.Histogram(
            "offload_serve_route_predicted_finish_seconds", description="Denoiser requests: the router's "
            "predicted finish on the replica it chose.", boundaries=FINISH_BUCKETS_S, tag_keys=tags)
        self.actual = metrics.Histogram(
            "offload_serve_route_actual_finish_seconds", description="Denoiser requests: routing to the "
            "last item, on the replica chosen.", boundaries=FINISH_BUCKETS_S, tag_keys=tags)
        self.error = metrics.Histogram(
            "offload_serve_route_prediction_error_ratio", description="|predicted - actual| / actual finish.",
            boundaries=ERROR_BUCKETS, tag_keys=tags)
        self.decisions = metrics.Counter(
            "offload_serve_route_decisions_total", description="Routing decisions by rule (predicted, "
            "default: a replica had no stats, none_fresh: all stale).", tag_keys=("rule",))


def spec_of(pending: PendingRequest | None) -> Any | None:
    """The GenerationSpec of a ``Denoiser.denoise(encoded, spec, ...)`` call; None for any other call."""
    if pending is None:
        return None
    spec = pending.kwargs.get("spec", pending.args[1] if len(pending.args) > 1 else None)
    return spec if all(hasattr(spec, a) for a in ("width", "height", "num_frames", "n", "steps")) else None


class PredictedFinishRouter(RequestRouter):
    """Earliest predicted finish; Serve's power of two choices while a replica has no stats."""

    def initialize_state(self, stats_period_s: float = DEFAULT_STATS_PERIOD_S, **kwargs) -> None:
        """``request_router_kwargs``: the deployment's ``request_routing_stats_period_s``."""
        self.stats_period_s = float(stats_period_s)
        self._loads: dict[ReplicaID, tuple[float, ReplicaLoad | None]] = {}
        self._sent: dict[ReplicaID, dict[str, _Sent]] = collections.defaultdict(dict)
        # internal request id -> (decision, its work, its request id, the future Serve routes it by)
        self._choices: dict[str, tuple[Choice, QueuedWork | None, str, Any]] = {}
        self._metrics = _Metrics()

    @property
    def stale_after_s(self) -> float:
        return STALE_PERIODS * self.stats_period_s

    def load_of(self, replica: RunningReplica) -> ReplicaLoad | None:
        stats = replica.routing_stats or {}
        cached = self._loads.get(replica.replica_id)
        if cached is not None and cached[0] == stats.get("at_s"):
            return cached[1]
        load = None
        if stats:
            try:
                load = ReplicaLoad.from_stats(stats)
            except StatsError as exc:
                logger.warning("replica %s: unreadable routing stats, routed as without: %s",
                               replica.replica_id.unique_id, exc)
        self._loads[replica.replica_id] = (stats.get("at_s"), load)
        return load

    def decide(self, candidate_replicas: list[RunningReplica], pending: PendingRequest | None,
               now_s: float) -> Choice:
        candidates = []
        for replica in candidate_replicas:
            load = self.load_of(replica)
            since = () if load is None else tuple(
                (s.sent_at_s - load.at_s, s.work) for s in self._sent[replica.replica_id].values()
                if s.sent_at_s > load.at_s)
            candidates.append(Candidate(replica.replica_id.unique_id, load, since))
        spec = spec_of(pending)
        work = None if spec is None else QueuedWork(Shape.of(spec), int(spec.run_steps))
        if work is None:
            made = decide.spread(candidates, now_s, self.stale_after_s)
        else:
            made = decide.choose(candidates, work.shape, work.steps, now_s, self.stale_after_s)
        if pending is not None:
            while len(self._choices) >= CHOICES_KEPT:  # requests cancelled before they were routed
                self._choices.pop(next(iter(self._choices)))
            request_id = getattr(spec, "request_id", None) or pending.metadata.request_id
            internal = pending.metadata.internal_request_id
            watched = self._choices.get(internal, (None,) * 4)[3]
            future = getattr(pending, "future", None)
            self._choices[internal] = (made, work, request_id, future)
            if future is not None and future is not watched:
                # Serve sets the future to the replica it picked for this request (without the FIFO
                # mixin, this request's own). Serve 2.60 calls on_request_routed only when strict
                # max_ongoing_requests is on, so this is how the router learns where each request went.
                future.add_done_callback(lambda done: self._routed_by_future(pending, done))
        return made

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        made = self.decide(candidate_replicas, pending_request, time.time())
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        return [[by_id[i] for i in rank if i in by_id] for rank in made.ranked]

    def _routed_by_future(self, pending: PendingRequest, done) -> None:
        if done.cancelled() or done.exception() is not None:
            return
        self.on_request_routed(pending, done.result().replica_id, None)

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        internal = pending_request.metadata.internal_request_id
        if internal in self._sent.get(replica_id, {}):
            return  # told twice (the future's callback and Serve's hook)
        made, work, request_id, _ = self._choices.pop(internal, (None, None, pending_request.metadata.request_id, None))
        if work is None:  # not a denoise call: nothing to predict or measure
            return
        cached = self._loads.get(replica_id)
        gpu = cached[1].gpu_type if cached is not None and cached[1] is not None else "unknown"
        prediction = made.prediction(replica_id.unique_id) if made is not None else None
        rule = made.rule if made is not None else Rule.DEFAULT
        self._sent[replica_id][internal] = _Sent(
            request_id, work, time.time(), gpu, rule, None if prediction is None else prediction.finish_s)
        self._metrics.decisions.inc(tags={"rule": rule.value})
        if prediction is not None:
            self._metrics.predicted.observe(prediction.finish_s, tags={"gpu_type": gpu})
        logger.info("request %s (%s, %d steps) -> Denoiser replica %s (%s): %s", request_id, work.shape.key,
                    work.steps, replica_id.unique_id, gpu,
                    f"predicted finish {prediction.finish_s:.3f} s"
                    f"{', joins its running batch' if prediction.joins_running else ''}; ranked {made.describe()}"
                    if prediction is not None else (made.describe() if made is not None else "no decision"))

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        sent = self._sent.get(replica_id, {}).pop(internal_request_id, None)
        self._choices.pop(internal_request_id, None)
        if sent is None:
            return
        actual = time.time() - sent.sent_at_s
        outcomes.OUTCOMES.append(outcomes.Outcome(sent.request_id, replica_id.unique_id, sent.gpu_type, sent.rule.value,
                                sent.predicted_s, actual, sent.sent_at_s))
        self._metrics.actual.observe(actual, tags={"gpu_type": sent.gpu_type})
        if sent.predicted_s is not None and actual > 0:
            self._metrics.error.observe(abs(sent.predicted_s - actual) / actual, tags={"gpu_type": sent.gpu_type})

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        """Nothing more goes there (Serve drops it from the candidates); what it had been sent fails
        with it, and each of those still completes (as an error) through :meth:`on_request_completed`."""
        super().on_replica_actor_died(replica_id)
        self._loads.pop(replica_id, None)
