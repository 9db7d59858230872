"""The router's decision, without Serve: which replicas a request may go to, in which order, and why.

Pure (runs in the process holding the Denoiser's handle, called by
:class:`deployments.routing.router.PredictedFinishRouter`; unit-tested with plain data). The rules, in
order:

1. A replica whose stats are older than ``stale_after_s`` (two stats periods: the controller could not
   get an answer twice, the replica is hung or gone) gets no more work while another replica's stats
   are fresh. When every replica's are stale, the controller is the likelier cause (it polled no
   Denoiser for 35 s during a config update in CI, while the old replica served and its requests
   waited 120 s in the router for fresh stats), so the decision is Serve's default over all of them:
   a hung replica is Serve's health check's to remove, never a reason to hold every request.
   A replica whose stats stay fresh while its running batch makes no progress (the batch's thread
   hung in a kernel or a lock, while the actor's event loop still answers the controller) counts as
   stale once the batch has gone :data:`STUCK_STEPS` of its own step times, and at least
   :data:`STUCK_FLOOR_S`, without a forward.
2. A replica without readable stats yet (just started) leaves the whole decision to Serve's default:
   power of two choices on queue length (two random replicas; Serve probes both, the shorter queue wins).
3. Otherwise each replica's predicted finish for this request (:func:`predicted_finish_s`: its
   running batch, its queue and the requests this router sent since its stats, replayed from the
   stats' time, at its measured seconds per step for the shape and batch size) ranks it; the
   earliest first.
"""
from __future__ import annotations

import enum
import random
from dataclasses import dataclass

from deployments.capacity.finish_model import Prediction, predicted_finish_s, with_peer_timings
from deployments.capacity.replica_load import QueuedWork, ReplicaLoad, Shape

# A running batch without a forward for this many of its measured step times is stuck; never sooner
# than the floor: a shape compiled on demand (tens of seconds on a GPU for a real model) or a first use
# measured on the request path legitimately holds a forward that long.
STUCK_STEPS = 10
STUCK_FLOOR_S = 30.0


class Rule(enum.Enum):
    PREDICTED = "predicted"  # ranked by predicted finish
    DEFAULT = "default"  # a replica without stats or timings: Serve's power of two choices
    NONE_FRESH = "none_fresh"  # every replica's stats are stale: Serve's power of two choices over all


@dataclass(frozen=True)
class Candidate:
    """One replica as the decision sees it."""

    replica: str
    load: ReplicaLoad | None  # None: no readable stats yet
    # What this router sent there after its stats were taken: (seconds after the stats, the work).
    sent: tuple[tuple[float, QueuedWork], ...] = ()


@dataclass(frozen=True)
class Choice:
    rule: Rule
    ranked: tuple[tuple[str, ...], ...]  # ranks of replica ids, most preferred first (Serve's shape)
    predictions: tuple[tuple[str, Prediction], ...] = ()  # by replica, in rank order (PREDICTED only)
    stale: tuple[str, ...] = ()  # replicas excluded by rule 1
    why: str = ""

    def prediction(self, replica: str) -> Prediction | None:
        return dict(self.predictions).get(replica)

    def describe(self) -> str:
        ranked = ", ".join(f"{r} {p.finish_s:.3f} s{' (joins its batch)' if p.joins_running else ''}"
                           for r, p in self.predictions)
        stale = f"; stale, skipped: {', '.join(self.stale)}" if self.stale else ""
        return f"{self.rule.value}: {ranked or self.why}{stale}"


def excluded(load: ReplicaLoad | None, now_s: float, stale_after_s: float) -> bool:
    """Rule 1: stats too old, or a running batch stuck (see the module docstring)."""
    if load is None:
        return False
    if load.age_s(now_s) > stale_after_s:
        return True
    if not load.running:
        return False
    timing = load.timing(load.running[0].shape, len(load.running))
    limit = max(STUCK_FLOOR_S, STUCK_STEPS * timing.seconds) if timing is not None else STUCK_FLOOR_S
    return load.stalled_s() + load.age_s(now_s) > limit


def _fresh(candidates: list[Candidate], now_s: float, stale_after_s: float,
           rng: random.Random | None) -> tuple[list[Candidate], tuple[str, ...], Choice | None]:
    """Rule 1 for both decisions: (the fresh candidates, the stale ones, the decision when none is fresh)."""
    stale = tuple(c.replica for c in candidates if excluded(c.load, now_s, stale_after_s))
    fresh = [c for c in candidates if c.replica not in stale]
    if fresh:
        return fresh, stale, None
    return fresh, stale, _default(candidates, stale, "every replica's stats are stale (the controller polls "
                                  "late): Serve's default over all", rng, Rule.NONE_FRESH)


def choose(candidates: list[Candidate], shape: Shape, steps: int, now_s: float, stale_after_s: float,
           rng: random.Random | None = None) -> Choice:
    fresh, stale, none_fresh = _fresh(candidates, now_s, stale_after_s, rng)
    if none_fresh is not None:
        return none_fresh
    if any(c.load is None for c in fresh):
        return _default(fresh, stale, "a replica has no stats yet", rng)
    peers = [c.load for c in fresh]
    predictions = []
    for c in fresh:
        load = with_peer_timings(c.load, peers)
        prediction = predicted_finish_s(load, shape, steps, c.load.age_s(now_s), c.sent)
        if prediction is None:
            return _default(fresh, stale, f"{c.replica} ({c.load.gpu_type}) has measured no step yet", rng)
        predictions.append((c.replica, prediction))
    predictions.sort(key=lambda p: (p[1].finish_s, p[0]))
    return Choice(Rule.PREDICTED, tuple((r,) for r, _ in predictions), tuple(predictions), stale)


def _default(among: list[Candidate], stale: tuple[str, ...], why: str, rng: random.Random | None,
             rule: Rule = Rule.DEFAULT) -> Choice:
    """Serve's power of two choices over ``among`` (no rank at all when there is no replica)."""
    picked = (rng or random).sample([c.replica for c in among], min(2, len(among)))
    return Choice(rule, (tuple(picked),) if picked else (), stale=stale, why=why)


def spread(candidates: list[Candidate], now_s: float, stale_after_s: float,
           rng: random.Random | None = None) -> Choice:
    """A call that is not a denoise (nothing to predict): Serve's default over the fresh replicas."""
    fresh, stale, none_fresh = _fresh(candidates, now_s, stale_after_s, rng)
    return none_fresh or _default(fresh, stale, "not a denoise call", rng)
