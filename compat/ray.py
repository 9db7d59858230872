"""Ray's and Ray Serve's private API, one function per use: the GCS's actor table and free resources, the
head node's resource, Serve's controller and client, Ray's address file. Runs in whichever process calls it.

Ray is imported inside each function, never here (importing it costs a second of CPU).
Public instead of private: Serve is started with ``serve.start`` (not ``ray.serve._private.api.serve_start``);
the state API (``ray.util.state``) would replace the GCS reads but needs the dashboard, which the tests'
and many clusters run without, so the GCS reads stay here.
"""
from __future__ import annotations

from typing import Any

from compat.checked import relies_on

CHECKED = ("2.60.0", "2.60.0")

GCS_WHY = "ray.util.state answers only through the dashboard, which many clusters run without"
SERVE_WHY = "Serve has no public handle on its controller"


@relies_on("ray", "ray._private.state.actors", CHECKED, GCS_WHY)
def actor_table_row(actor_id: str) -> dict[str, Any]:
    """The GCS actor table's row of one actor ({} when the GCS does not know it): ``State``, ``NumRestarts``..."""
    from ray._private.state import actors

    return actors(actor_id=actor_id) or {}


@relies_on("ray", "ray._private.state.available_resources_per_node", CHECKED, GCS_WHY)
def available_resources_per_node() -> dict[str, dict[str, float]]:
    """Per alive node id, the resources Ray has not allocated yet (``ray.nodes()`` gives only totals)."""
    from ray._private.state import available_resources_per_node as per_node

    return per_node()


@relies_on("ray", "ray._common.constants.HEAD_NODE_RESOURCE_NAME ('node:__internal_head__')", CHECKED,
           "Ray offers no public way to place an actor on the head node")
def on_head_node(amount: float = 0.001) -> dict[str, float]:
    """``resources=`` for an actor that must run on the head node (a token amount of its marker resource)."""
    from ray._common.constants import HEAD_NODE_RESOURCE_NAME

    return {HEAD_NODE_RESOURCE_NAME: amount}


@relies_on("ray", "ray.serve._private.constants.SERVE_CONTROLLER_NAME, SERVE_NAMESPACE", CHECKED, SERVE_WHY)
def serve_controller():
    """The handle of Serve's controller actor (raises ValueError when Serve is not running)."""
    import ray
    from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE

    return ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)


@relies_on("ray", "ray.serve.context._get_global_client", CHECKED, SERVE_WHY)
def serve_client():
    """Serve's controller client, cached by Serve (None when no controller runs): ``serve.status()``'s."""
    from ray.serve.context import _get_global_client

    return _get_global_client(raise_if_no_controller_running=False)


@relies_on("ray", "ServeControllerClient.deploy_apps(config, _blocking=False)", CHECKED,
           "a config file's applications with their per-deployment overrides deploy only through it "
           "(what `serve run config.yaml` calls)")
def deploy_config(config) -> None:
    """What ``serve run <config file>`` does: start Serve with the file's options, deploy its apps, return."""
    from ray import serve

    serve.start(http_options=config.http_options.model_dump(), proxy_location=config.proxy_location)
    serve_client().deploy_apps(config, _blocking=False)


@relies_on("ray", "ray._common.utils.get_ray_address_file", CHECKED,
           "where `ray start` records the running head for `ray.init()` is not public")
def address_file(temp_dir: str | None = None) -> str:
    """Ray's ``ray_current_cluster`` file (where ``ray.init()`` and ``serve run`` look for a running head)."""
    from ray._common.utils import get_ray_address_file

    return get_ray_address_file(temp_dir)


@relies_on("ray", "ray.init(_node_ip_address=...)", CHECKED,
           "ray.init has no public argument for the address a new local node binds its services to")
def init_local_node(node_ip: str, **init_kwargs) -> None:
    """``ray.init`` of a new cluster of this process's own whose node announces ``node_ip``."""
    import ray

    ray.init(address="local", _node_ip_address=node_ip, **init_kwargs)
