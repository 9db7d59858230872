"""What Ray has not placed, and whether it ever can: read from Serve's controller and the GCS.

The arithmetic is :mod:`deployments.capacity.gpu_shares` (pure, tested with fake facts); this module reads
the facts. Serve itself says a replica is unplaced only after 30 s (``RAY_SERVE_SLOW_STARTUP_WARNING_S``:
"Deployment ... has N replicas that have taken more than 30s to be scheduled"), in a log line and the
deployment's status message; ``GET /v1/residency`` shows every replica still waiting for a node at
once, with what it wants and which node falls short by how much, and Serve's message once it has one.
"""
from __future__ import annotations

import logging
import time
from typing import Mapping

from cluster.node import ACCELERATOR_PREFIX
from compat.ray import available_resources_per_node, serve_client, serve_controller
from deployments.capacity.gpu_shares import GpuDemand, GpuNode, PendingReplica, capacity_warning, why_pending

logger = logging.getLogger(__name__)

# num_replicas: "auto" is Serve's default autoscaling, whose max_replicas is 100 (AutoscalingConfig.default()).
AUTO_MAX_REPLICAS = 100
# Serve warns of a replica still starting 30 s after it was asked for (RAY_SERVE_SLOW_STARTUP_WARNING_S).
# One placed on a node by then is loading its weights, or waiting for its node ledger to grant the
# device bytes its plan keeps (deployments/replica/leases.py: it waits rather than failing its start).
SLOW_START_S = 30.0


def gpu_nodes(free: bool = False) -> tuple[GpuNode, ...]:
    """Every alive Ray node's GPUs; ``free``: with what Ray has not allocated yet (else all of it)."""
    import ray

    available = available_resources_per_node() if free else {}
    nodes = []
    for node in ray.nodes():
        if not node["Alive"]:
            continue
        resources, node_id = node["Resources"], node["NodeID"]
        gpus = int(resources.get("GPU", 0))
        types = frozenset(k[len(ACCELERATOR_PREFIX):] for k in resources if k.startswith(ACCELERATOR_PREFIX))
        left = float(available.get(node_id, {}).get("GPU", 0.0)) if free else float(gpus)
        nodes.append(GpuNode(node_id, gpus, left, types))
    return tuple(nodes)


def autoscaler_detected() -> bool:
    """Ray's autoscaler v2 is on in the GCS. KubeRay's in-tree (v1) autoscaler is not visible from
    here: its manifests say so in the app's args (``cluster_autoscaler: true``, k8s/render.py)."""
    from ray.autoscaler.v2.utils import is_autoscaler_v2

    try:
        return is_autoscaler_v2(fetch_from_server=True)
    except Exception as exc:  # an old GCS without the key, or none reachable: say so and assume none
        logger.info("cannot tell whether the cluster autoscales (%s): assuming it does not", exc)
        return False


def _plain(options) -> dict:
    """A Serve option object (pydantic, DEFAULT sentinels) or dict, as a dict of what was set."""
    if options is None:
        return {}
    if hasattr(options, "model_dump"):
        return options.model_dump(exclude_unset=True)
    return dict(options)


def demand_of(name: str, options: Mapping) -> GpuDemand:
    """One deployment's GPU demand at its configured maximum, from its Serve options (as set)."""
    actor = _plain(options.get("ray_actor_options"))
    autoscaling = _plain(options.get("autoscaling_config"))
    replicas = options.get("num_replicas", 1)
    if autoscaling or replicas == "auto":
        replicas = int(autoscaling.get("max_replicas", AUTO_MAX_REPLICAS if replicas == "auto" else 1))
    return GpuDemand(name, float(actor.get("num_gpus") or 0.0), int(replicas), actor.get("accelerator_type"))


def deployed_overrides(app_name: str) -> dict[str, dict]:
    """The config file's per-deployment options of ``app_name`` (Serve applies them over build_app's
    after it returns), when build_app runs in Serve's build task of ``serve run/deploy config.yaml``;
    {} when it runs in a driver (``serve.run(build_app(...))``: its own options are the final ones)."""
    import ray

    if not ray.is_initialized() or ray.get_runtime_context().worker.mode != ray.WORKER_MODE:
        return {}
    from ray.serve.schema import ServeInstanceDetails

    controller = serve_controller()
    details = ServeInstanceDetails.model_validate(ray.get(controller.get_serve_instance_details.remote()))
    app = details.applications.get(app_name)
    if app is None or app.deployed_app_config is None:
        return {}
    return {d.name: _plain(d) for d in app.deployed_app_config.deployments}


def warn_if_unplaceable(app_name: str, options: Mapping[str, Mapping], *, overrides: Mapping | None = None,
                        nodes: tuple[GpuNode, ...] | None = None, autoscaler: bool | None = None) -> str | None:
    """Log one WARNING (and return it) when the configured maximum replicas x num_gpus can never be
    placed on the cluster's GPUs and nothing will add GPUs. ``options``: build_app's per deployment;
    ``overrides`` (the config file's), ``nodes`` and ``autoscaler`` are read from Ray unless given."""
    import ray

    if nodes is None and not ray.is_initialized():
        return None  # nothing to place on yet: Serve starts Ray when it deploys
    if autoscaler is None:
        autoscaler = autoscaler_detected()
    if autoscaler:
        return None
    overrides = deployed_overrides(app_name) if overrides is None else overrides
    merged = {name: {**opts, **overrides.get(name, {})} for name, opts in options.items()}
    demands = [demand_of(name, opts) for name, opts in merged.items()]
    warning = capacity_warning(demands, gpu_nodes() if nodes is None else nodes)
    if warning is not None:
        logger.warning("%s: %s", app_name, warning)
    return warning


def serve_details() -> dict:
    """Every application's details as Serve's controller sends them: one call, the plain dict of the REST
    API's ``ServeInstanceDetails`` JSON (``{}`` before Serve starts).

    Read as dicts, not through ``serve.status()``: that validates the whole reply into pydantic models, and
    each deployment's ``RequestRouterConfig`` cloudpickles its router class on the way: most of the CPU of
    the ingress's watch, which reads it every 2 s."""
    client = serve_client()  # serve.status()'s; the handle is cached
    return {} if client is None else client.get_serve_details()


def replica_waits(replica: Mapping, now: float) -> bool:
    """A replica (a dict of :func:`serve_details`) Serve has asked for that Ray has not placed on a node,
    or that is still starting on one :data:`SLOW_START_S` after it was asked for."""
    if replica.get("state") != "STARTING":
        return False
    return replica.get("node_id") is None or now - float(replica.get("start_time_s") or now) > SLOW_START_S


def _still_starting(node_id: str, waited_s: float) -> str:
    return (f"placed on node {node_id[:8]} {waited_s:.0f} s ago and still starting: loading its weights, or "
            "waiting for its node ledger to grant the device bytes its plan keeps (each refusal is a line "
            "in the replica's log)")


def pending_replicas(app_name: str, now: float | None = None, details: Mapping | None = None
                     ) -> tuple[PendingReplica, ...]:
    """Replicas of ``app_name`` Serve has asked for that Ray has not placed on a node yet, each with why.
    ``details``: a :func:`serve_details` reply already read (the ingress's watch reads one for both)."""
    from ray.serve.schema import ApplicationDetails, ReplicaState

    details = serve_details() if details is None else details
    raw = details.get("applications", {}).get(app_name)
    now = time.time() if now is None else now
    if raw is None or not any(replica_waits(r, now) for d in raw.get("deployments", {}).values()
                              for r in d.get("replicas", ())):
        return ()  # the usual answer, without the schema's models or the GCS's nodes
    app = ApplicationDetails.model_validate(raw)
    nodes, pending = None, []
    for name, deployment in app.deployments.items():
        waiting = [r for r in deployment.replicas if r.state == ReplicaState.STARTING
                   and replica_waits({"state": "STARTING", "node_id": r.node_id, "start_time_s": r.start_time_s}, now)]
        if not waiting:
            continue
        nodes = gpu_nodes(free=True) if nodes is None else nodes
        config = deployment.deployment_config
        actor = _plain(config.ray_actor_options)
        demand = demand_of(name, {"ray_actor_options": actor})
        wanted = tuple((k, float(v)) for k, v in (("CPU", actor.get("num_cpus")), ("GPU", actor.get("num_gpus")),
                                                  ("memory", actor.get("memory"))) if v)
        wanted += tuple((k, float(v)) for k, v in sorted((actor.get("resources") or {}).items()))
        if demand.accelerator_type:
            wanted += ((f"{ACCELERATOR_PREFIX}{demand.accelerator_type}", 0.001),)
        reason = why_pending(demand, nodes)
        pending += [PendingReplica(name, r.replica_id, wanted, max(0.0, now - r.start_time_s),
                                   reason if r.node_id is None else _still_starting(r.node_id, now - r.start_time_s),
                                   deployment.message or "") for r in waiting]
    return tuple(pending)
