"""Each routed Denoiser request's predicted and actual finish, kept in the process holding the handle.

Its own module because Serve ships the router's module to every handle by value (cloudpickle, so a
change to the router needs no redeploy of the code): state kept there would be a copy in the router,
invisible to the rest of the process. This module is imported by reference, so the bench, a test or
an operator's shell reads :data:`OUTCOMES` where the router appends to it.
"""
from __future__ import annotations

import collections
from dataclasses import dataclass

# A long-running ingress keeps this many (a bounded tail; the metrics keep the distributions).
OUTCOMES_KEPT = 100_000


@dataclass(frozen=True)
class Outcome:
    """One routed request's predicted and actual finish (from routing to its last item)."""

    request_id: str
    replica: str  # Serve's replica unique id
    gpu_type: str
    rule: str  # deployments.routing.choice.Rule's value
    predicted_s: float | None  # None: routed by Serve's default (no prediction)
    actual_s: float
    routed_at_s: float  # wall clock


OUTCOMES: collections.deque[Outcome] = collections.deque(maxlen=OUTCOMES_KEPT)
