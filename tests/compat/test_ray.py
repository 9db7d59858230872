"""Ray's private API as compat/ray.py relies on it, read without starting Ray: each test fails, naming the
seam, when an upgrade moved it. The seams' behaviour on a live cluster is exercised by the tests of their
callers (tests/cluster/ledger for the actor table, tests/deployments for Serve's client and controller)."""
from __future__ import annotations

import inspect
import os

from compat import ray as seam
from compat.checked import REGISTRY


def use(name: str):
    return REGISTRY[f"compat.ray.{name}"]


def parameters(fn) -> set[str]:
    return set(inspect.signature(fn).parameters)


def test_gcs_tables_take_what_the_seams_pass():
    from ray._private import state

    assert "actor_id" in parameters(state.actors), use("actor_table_row").mismatch("no longer takes actor_id")
    assert all(p.default is not p.empty or p.kind is p.VAR_KEYWORD
               for p in inspect.signature(state.available_resources_per_node).parameters.values()), \
        use("available_resources_per_node").mismatch("now needs an argument")


def test_head_node_resource_is_ray_own_marker():
    resources = seam.on_head_node(0.5)
    assert resources == {"node:__internal_head__": 0.5}, use("on_head_node").mismatch(f"is now {resources}")


def test_serve_controller_and_client_are_where_serve_keeps_them():
    from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE
    from ray.serve.context import _get_global_client

    assert isinstance(SERVE_CONTROLLER_NAME, str) and isinstance(SERVE_NAMESPACE, str), \
        use("serve_controller").mismatch("moved")
    assert "raise_if_no_controller_running" in parameters(_get_global_client), use("serve_client").mismatch("changed")


def test_config_deploys_through_the_client_without_blocking():
    from ray import serve
    from ray.serve._private.client import ServeControllerClient

    assert {"config", "_blocking"} <= parameters(ServeControllerClient.deploy_apps), \
        use("deploy_config").mismatch("lost _blocking")
    assert {"http_options", "proxy_location"} <= parameters(serve.start)


def test_local_node_address_and_address_file(tmp_path):
    import ray

    source = inspect.getsource(inspect.unwrap(ray.init))  # a private keyword: ray.init pops it from **kwargs
    assert 'kwargs.pop("_node_ip_address"' in source, use("init_local_node").mismatch("is no longer read")
    named = seam.address_file(str(tmp_path))
    assert named == os.path.join(str(tmp_path), "ray_current_cluster"), use("address_file").mismatch(f"is {named}")
