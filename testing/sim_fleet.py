"""A mixed fleet of stand-in Denoisers on a local Ray cluster: nodes of simulated GPU types, apps over them.

For bench/mixed_fleet.py and tests/deployments/routing/test_routing_service.py. Each node added
carries ``<gpu resource>: n`` (what a replica asks for: a GPU, not a type) and
``sim_gpu_type:<type>: n`` (what the replica reads to know its type, as a KubeRay worker group's
label); :func:`sim_app` builds one Denoiser deployment over them with the router of ``mode``.
"""
from __future__ import annotations

from deployments.replica.batching import BatchingConfig
from deployments.routing.config import RoutingMode, router_options
from testing.sim_denoiser import GPU_RESOURCE, TYPE_RESOURCE, SimCost, SimDenoiser, SimFaults


def add_sim_nodes(cluster, per_type: dict[str, int], resources: tuple[str, ...] = (GPU_RESOURCE,)) -> list:
    """One node per type with ``per_type[type]`` of each resource in ``resources`` (one name per app
    that should get exactly that many replicas there); returns the nodes (``cluster.remove_node`` each)."""
    nodes = []
    for gpu_type, count in per_type.items():
        extra = {name: float(count) for name in resources}
        extra[f"{TYPE_RESOURCE}{gpu_type}"] = float(count * len(resources))
        nodes.append(cluster.add_node(num_cpus=0, resources=extra))
    cluster.wait_for_nodes()
    # A raylet that exits at start can still have registered: its replica would then wait for it forever.
    dead = {gpu_type: [kind for kind, _ in node.dead_processes()]
            for gpu_type, node in zip(per_type, nodes) if node.dead_processes()}
    if dead:
        raise RuntimeError(f"simulated node processes exited at start: {dead}; their logs are under "
                           f"{nodes[0].get_session_dir_path()}/logs")
    return nodes


def sim_app(cost: SimCost, mode: RoutingMode, replicas: int, stats_period_s: float,
            batching: BatchingConfig = BatchingConfig(), faults: SimFaults = SimFaults(),
            resource: str = GPU_RESOURCE, graceful_shutdown_timeout_s: float = 30.0):
    """The stand-in Denoiser as ``build_app`` would deploy the real one: max_ongoing_requests = max_batch,
    the router of ``mode`` with its stats period."""
    options = dict(num_replicas=replicas, max_ongoing_requests=batching.max_batch,
                   ray_actor_options={"num_cpus": 0, "resources": {resource: 1}},
                   graceful_shutdown_timeout_s=graceful_shutdown_timeout_s, graceful_shutdown_wait_loop_s=0.2,
                   **router_options(mode, stats_period_s))
    return SimDenoiser.options(**options).bind(cost, batching, faults)
