"""Which request router a stage deployment gets, as Serve options: built by ``build_app`` (the driver)
and by the mixed-fleet bench."""
from __future__ import annotations

import enum

from ray.serve.config import RequestRouterConfig

from deployments.routing.router import DEFAULT_STATS_PERIOD_S, PredictedFinishRouter


class RoutingMode(str, enum.Enum):
    # Earliest predicted finish from the replicas' routing stats (deployments/routing/router.py).
    PREDICTED = "predicted"
    # Serve's default: power of two choices on queue length.
    DEFAULT = "default"


ROUTER_CLASS = f"{PredictedFinishRouter.__module__}:{PredictedFinishRouter.__qualname__}"


def router_options(mode: RoutingMode, stats_period_s: float = DEFAULT_STATS_PERIOD_S) -> dict:
    """Serve deployment options for ``mode`` (empty for Serve's default). The controller asks each
    replica for its stats every ``stats_period_s`` and gives up on an answer after as long; the router
    counts a replica's stats stale after two periods."""
    if mode is RoutingMode.DEFAULT:
        return {}
    return {"request_router_config": RequestRouterConfig(
        request_router_class=ROUTER_CLASS, request_router_kwargs={"stats_period_s": stats_period_s},
        request_routing_stats_period_s=stats_period_s, request_routing_stats_timeout_s=stats_period_s)}
