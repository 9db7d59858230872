"""Autoscaling on work: a Serve autoscaling policy that sizes a stage by predicted work-seconds per
replica, not by ongoing requests.

Serve's default policy counts ongoing requests: a queue on an L4 replica streaming a 14B DiT looks
like the same queue on an H100 holding it resident, and a 50-step video counts as a 4-step image.
Here each replica reports the seconds of work it holds, priced at its own measured seconds per step
(:func:`autoscaling_stats` over its :class:`~deployments.capacity.replica_load.ReplicaLoad`, through
the router's finish model), and the policy asks for ``work / target_work_s`` replicas:

- the work of every replica whose stats are fresh, summed (a slow replica's queue weighs more);
- requests no fresh stats account for (queued at the handles, or on a replica whose stats are stale
  or absent) priced at the fleet's mean seconds per request;
- no fresh stats at all (a fleet that just started, or hung): Serve's own rule for that tick,
  ongoing requests / ``target_ongoing_requests``, said in the log line;
- clamped to the deployment's min/max (Serve's capacity-adjusted bounds), as Serve's rule is.

A replica's stats are fresh until max(3 metrics intervals, 10 s) pass without a report, as Serve
counts a handle's; its last report is kept in the policy's state, so it still counts between two
reports further apart than the look-back window that Serve keeps its series over.

Serve's wrapper then applies its delays and up/down scaling factors, as for its own policy.
Which replica a scale-down removes is not the policy's to say in Ray 2.60: the policy returns a
count, and Serve's scheduler picks (replicas not yet running, then off the head node, on nodes with
the fewest replicas, newest first); docs/operations.md#autoscaling-on-work says what that means.

Runs in two processes: :func:`autoscaling_stats` in each Denoiser replica (its
``record_autoscaling_stats``, every ``metrics_interval_s``), :class:`WorkPolicy` in Serve's controller
(each control-loop tick). Pure Python: the policy reads Serve's ``AutoscalingContext`` by its public
attributes and never imports Ray.
"""
from __future__ import annotations

import enum
import logging
import math
from dataclasses import astuple, dataclass
from typing import Any, Hashable, Mapping

from deployments.capacity.finish_model import work_seconds
from deployments.capacity.replica_load import ReplicaLoad

# Under Serve's logger: in the controller only "ray.serve" has handlers (its controller log file).
logger = logging.getLogger("ray.serve").getChild(__name__)

# What a replica's record_autoscaling_stats returns (Serve wants dict[str, float]), by key.
WORK_S = "work_s"  # seconds of work it holds (running batch and queue), at its own step times
REQUESTS = "requests"  # requests it holds
REQUEST_S = "request_s"  # its mean seconds per held request (kept from the last time it held any)

# The import path a Serve config names (autoscaling_config.policy.policy_function).
POLICY_PATH = "deployments.capacity.work_autoscaling:WorkPolicy"
# 30 s of queued work per replica: a 28-step 1024x1024 FLUX image on an L40S (~0.5 s a step) is
# ~14 s, so a replica holding two and a half of them asks for another; the 4-step ones barely count.
DEFAULT_TARGET_WORK_S = 30.0
# Stats older than this many metrics intervals, and than STALE_FLOOR_S, are stale (a hung replica stops
# answering its record_autoscaling_stats and its series stops growing).
STALE_INTERVALS = 3.0
# Serve's own floor for a handle's metrics (RAY_SERVE_MIN_HANDLE_METRICS_TIMEOUT_S, Ray 2.60): a report
# counts until max(2 intervals, 10 s) pass without one. Serve delivers a replica's points when its
# controller gets to them: at metrics_interval_s 0.2 s on the CI VM, a busy replica's came 1.35 s apart
# (0.67-1.01 s old at a tick), so 3 intervals (0.6 s) called a healthy replica stale every other tick
# and the count flapped 1 -> 2 -> 1, stopping each new replica while it started.
STALE_FLOOR_S = 10.0
# policy_state key: each running replica's last report (Serve keeps a series only over look_back_period_s,
# so between two reports further apart than that a replica has none, while its last one is still fresh).
LAST_REPORTS = "work_policy.last_reports"


def autoscaling_stats(load: ReplicaLoad, last_request_s: float | None = None) -> dict[str, float]:
    """A replica's autoscaling stats from its load. ``last_request_s``: its ``REQUEST_S`` from the last
    time it held work (an idle replica still prices a request). No ``WORK_S`` when it holds work it
    has measured no step of: the policy then counts its requests as the fleet's mean."""
    held = len(load.running) + len(load.waiting)
    stats = {REQUESTS: float(held)}
    work = work_seconds(load)
    if work is not None:
        stats[WORK_S] = float(work)
        if held:
            stats[REQUEST_S] = float(work) / held
    if REQUEST_S not in stats and last_request_s is not None:
        stats[REQUEST_S] = float(last_request_s)
    return stats


@dataclass(frozen=True)
class ReplicaWork:
    """One running replica as the controller last heard from it."""

    replica: str
    work_s: float | None  # None: absent or stale
    requests: float
    request_s: float | None


@dataclass(frozen=True)
class FleetWork:
    """What one control-loop tick knows of a deployment's work."""

    replicas: tuple[ReplicaWork, ...]
    total_requests: float  # Serve's ongoing requests: at the replicas and queued at the handles
    current: int  # running replicas
    min_replicas: int
    max_replicas: int
    target_ongoing_requests: float  # Serve's rule, for the fallback


class ScalingSignal(enum.Enum):
    """What a stage's autoscaling counts (``AppArgs.denoiser_scales_on``)."""

    WORK = "work"  # predicted work-seconds per replica: WorkPolicy
    REQUESTS = "requests"  # ongoing requests per replica: Serve's default policy


class Basis(enum.Enum):
    """What a decision stood on."""

    WORK = "work"  # every request priced from fresh stats
    NO_STATS = "no fresh stats: ongoing requests"  # Serve's rule for this tick


@dataclass(frozen=True)
class ScalingDecision:
    """One tick's replica count and the numbers behind it (its log line)."""

    replicas: int
    wanted: float  # before the min/max clamp
    work_s: float  # total predicted work-seconds (0 on the fallback)
    unaccounted: float  # requests priced at the fleet's mean
    stale: int  # running replicas without fresh stats
    basis: Basis

    def describe(self, name: str, current: int, target_work_s: float) -> str:
        if self.basis is Basis.NO_STATS:
            how = f"{self.basis.value} -> {self.wanted:.2f}"
        else:
            how = (f"{self.work_s:.1f} s of work ({self.unaccounted:.0f} requests at the fleet's mean) / "
                   f"{target_work_s:.0f} s per replica = {self.wanted:.2f}")
        return (f"{name}: {current} -> {self.replicas} replicas: {how}; {self.stale} without fresh stats")


def decide(fleet: FleetWork, target_work_s: float) -> ScalingDecision:
    """The replica count the fleet's work asks for (see the module's docstring for the rules)."""
    fresh = [r for r in fleet.replicas if r.work_s is not None]
    stale = len(fleet.replicas) - len(fresh)
    held = sum(r.requests for r in fresh)
    work = sum(r.work_s for r in fresh)
    unaccounted = max(0.0, fleet.total_requests - held)
    priced = [r.request_s for r in fresh if r.request_s]
    per_request = work / held if held > 0 else (sum(priced) / len(priced) if priced else None)
    if not fresh or (unaccounted > 0 and per_request is None):
        wanted = fleet.total_requests / fleet.target_ongoing_requests
        return ScalingDecision(_clamp(wanted, fleet), wanted, 0.0, unaccounted, stale, Basis.NO_STATS)
    work += unaccounted * (per_request or 0.0)
    wanted = work / target_work_s
    return ScalingDecision(_clamp(wanted, fleet), wanted, work, unaccounted, stale, Basis.WORK)


def _clamp(wanted: float, fleet: FleetWork) -> int:
    return max(fleet.min_replicas, min(fleet.max_replicas, math.ceil(wanted - 1e-9)))


def _last_timestamp(series: Any) -> float | None:
    """The newest point's time in one of Serve's metric series (a list of (timestamp, value) points)."""
    times = [point.timestamp for point in series or ()]
    return max(times) if times else None


@dataclass(frozen=True)
class Report:
    """A replica's stats as the controller last received them (kept across ticks in ``policy_state``)."""

    seen: float  # the newest point's time
    work_s: float | None
    requests: float
    request_s: float | None


def last_reports(ctx: Any) -> dict[str, Report]:
    """Each running replica's newest report: this tick's series where it has one, else the one kept
    from an earlier tick (its series emptied between two reports)."""
    aggregated: Mapping[str, Mapping[Hashable, float]] = ctx.aggregated_metrics or {}
    raw: Mapping[str, Mapping[Hashable, Any]] = ctx.raw_metrics or {}
    kept = (ctx.policy_state or {}).get(LAST_REPORTS, {})
    reports = {}
    for replica in ctx.running_replicas:
        name = str(getattr(replica, "unique_id", replica))
        times = [_last_timestamp(raw.get(key, {}).get(replica)) for key in (WORK_S, REQUESTS)]
        seen = max((t for t in times if t is not None), default=None)
        if seen is not None:  # no WORK_S: it measured no step yet (its requests count at the fleet's mean)
            work = aggregated.get(WORK_S, {}).get(replica) if times[0] is not None else None
            reports[name] = Report(seen, work,
                                   float(aggregated.get(REQUESTS, {}).get(replica, 0.0)),
                                   aggregated.get(REQUEST_S, {}).get(replica))
        elif name in kept:
            reports[name] = Report(*kept[name])
    return reports


def fleet_work(ctx: Any, stale_after_s: float, reports: Mapping[str, Report] | None = None) -> FleetWork:
    """Read one tick's :class:`FleetWork` from Serve's ``AutoscalingContext`` (by its public attributes)
    and the replicas' last ``reports`` (:func:`last_reports` when None)."""
    reports = last_reports(ctx) if reports is None else reports
    replicas = []
    for replica in ctx.running_replicas:
        name = str(getattr(replica, "unique_id", replica))
        report = reports.get(name)
        if report is None:
            replicas.append(ReplicaWork(name, None, 0.0, None))
            continue
        fresh = ctx.current_time - report.seen <= stale_after_s
        replicas.append(ReplicaWork(name, report.work_s if fresh else None, report.requests, report.request_s))
    return FleetWork(tuple(replicas), float(ctx.total_num_requests), int(ctx.current_num_replicas),
                     int(ctx.capacity_adjusted_min_replicas), int(ctx.capacity_adjusted_max_replicas),
                     float(ctx.config.get_target_ongoing_requests()))


class WorkPolicy:
    """Serve's custom autoscaling policy (``autoscaling_config.policy``: ``policy_function`` =
    :data:`POLICY_PATH`, ``policy_kwargs`` = this constructor's). Serve makes one per deployment and
    calls it every control-loop tick; it logs a decision once, when the count it wants changes."""

    def __init__(self, target_work_s: float = DEFAULT_TARGET_WORK_S, stale_after_s: float | None = None):
        if target_work_s <= 0:
            raise ValueError(f"target_work_s must be > 0 seconds, got {target_work_s}")
        self.target_work_s = float(target_work_s)
        # None: max(STALE_INTERVALS x the deployment's metrics_interval_s, STALE_FLOOR_S)
        self.stale_after_s = stale_after_s

    def __call__(self, ctx: Any) -> tuple[int, dict]:
        stale_after = self.stale_after_s
        if stale_after is None:
            stale_after = max(STALE_INTERVALS * float(ctx.config.metrics_interval_s), STALE_FLOOR_S)
        reports = last_reports(ctx)
        decision = decide(fleet_work(ctx, stale_after, reports), self.target_work_s)
        said = (decision.replicas, decision.basis.value)
        if ctx.policy_state.get("work_policy.said") != list(said):
            logger.info("%s", decision.describe(ctx.deployment_name, ctx.current_num_replicas, self.target_work_s))
        kept = {name: list(astuple(report)) for name, report in reports.items()}  # Report(*kept)
        return decision.replicas, {"work_policy.said": list(said), LAST_REPORTS: kept}


def _plain(config: Any) -> dict:
    """An autoscaling_config as a dict of what was set (a dict, or Serve's pydantic AutoscalingConfig)."""
    return config.model_dump(exclude_unset=True) if hasattr(config, "model_dump") else dict(config)


def with_policy(options: Mapping[str, Any], signal: ScalingSignal, target_work_s: float) -> dict:
    """A deployment's Serve options with :class:`WorkPolicy` in its ``autoscaling_config`` when it
    autoscales, scales on work and names no policy of its own; else unchanged."""
    options = dict(options)
    config = options.get("autoscaling_config")
    if signal is not ScalingSignal.WORK or not config:
        return options
    config = _plain(config)
    if config.get("policy"):
        return options  # the caller's policy, whichever it is
    config["policy"] = {"policy_function": POLICY_PATH, "policy_kwargs": {"target_work_s": target_work_s}}
    options["autoscaling_config"] = config
    return options


def dropped_policy(name: str, override: Mapping[str, Any], signal: ScalingSignal) -> str | None:
    """The WARNING to log when a Serve config file's ``autoscaling_config`` for ``name`` (which replaces
    build_app's whole) names no policy while the app scales it on work; None when it does."""
    config = override.get("autoscaling_config")
    if signal is not ScalingSignal.WORK or not config:
        return None
    policy = _plain(config).get("policy") or {}
    function = policy.get("policy_function") if isinstance(policy, Mapping) else getattr(policy, "policy_function", "")
    if function == POLICY_PATH:
        return None
    return (f"{name}: the config file's autoscaling_config replaces build_app's and names "
            f"{function or 'no'} policy, so it scales on {'that policy' if function else 'ongoing requests'}, "
            f"not on work; add policy: {{policy_function: {POLICY_PATH}}} to it, or set "
            f"denoiser_scales_on: requests to mean it")
