"""Session-wide fixtures. One Ray cluster per test session, started only by tests that ask for it."""
from __future__ import annotations

import os
import socket

import pytest

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# Tests plan from models built on meta every time, never from a profile a previous run cached
# (offload_core/planner/facts_cache.py); its own tests turn it on in a temporary folder.
os.environ.setdefault("OFFLOAD_SERVE_PLAN_CACHE", "0")

# 200 MiB per node: tensors between stages are small for the tiny zoo, and several nodes share 24 GiB.
OBJECT_STORE_BYTES = 200 * 1024 * 1024
METRICS_REPORT_MS = 1000


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# The modules that run on Ray: the session's ``ray_cluster`` (checked at collection, below) or a head of
# their own (the serve command's). ``make test`` runs ``-n 2``: these go to one worker as one unit, in
# collection order, since the session's one cluster, the shared app's order (tests/deployments/conftest.py)
# and the checks that no Ray process is left all assume one Ray user at a time; the in-process tests
# (model logic) run on the other core meanwhile.
RAY_MODULES = frozenset({
    "tests/cluster/ledger/test_actor.py", "tests/cluster/ledger/test_shared_stores.py",
    "tests/cluster/replica/test_device_leases.py", "tests/cluster/replica/test_ledger_view.py",
    "tests/cluster/replica/test_neighbours.py", "tests/cluster/replica/test_plan.py",
    "tests/cluster/test_autoscale.py", "tests/deployments/capacity/test_limits_service.py",
    "tests/deployments/dev/test_serve_command.py", "tests/deployments/ingress/test_families_service.py",
    "tests/deployments/ingress/test_health_service.py", "tests/deployments/ingress/test_service.py",
    "tests/deployments/ingress/test_service_flux.py", "tests/deployments/ingress/test_service_lifecycle.py",
    "tests/deployments/ingress/test_service_sd3.py", "tests/deployments/ingress/test_video_jobs_service.py",
    "tests/deployments/replica/test_shards.py", "tests/deployments/replica/test_tensor_parallel_service.py",
    "tests/test_ray_fixture.py",
})


def pytest_collection_modifyitems(items):
    """A module that uses the session's Ray cluster must be in RAY_MODULES (else two workers would each
    start a cluster)."""
    missing = sorted({item.nodeid.split("::")[0] for item in items if "ray_cluster" in item.fixturenames}
                     - RAY_MODULES)
    if missing:
        raise pytest.UsageError(f"tests/conftest.py: add {missing} to RAY_MODULES (they use ray_cluster)")


def pytest_xdist_make_scheduler(config, log):
    """pytest-xdist's scheduler with every RAY_MODULES test in one unit (its ``xdist_group`` mark does not
    group under pytest 9.2: xdist 3.8 renames ``item._nodeid``, which pytest 9 no longer reads)."""
    from xdist.scheduler import LoadScopeScheduling

    class RayInOneWorker(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return "ray" if nodeid.split("::")[0] in RAY_MODULES else nodeid

    return RayInOneWorker(config, log)


@pytest.fixture
def remove_after():
    """``remove_after(thing)`` returns ``thing`` and calls its ``remove()`` when the test ends, passed or
    failed, so no hook, meter or host lease of a streamed model outlives its test.

    For what offload_core applies (streamers, host tables, a pipeline's residency, a stage's). A test
    may still call ``thing.remove()`` itself, to check what removal does; teardown does not repeat it.
    """
    owned = []

    def own(thing):
        remove, done = thing.remove, []

        def remove_once():
            if not done:
                done.append(True)
                remove()

        thing.remove = remove_once
        owned.append(thing)
        return thing

    yield own
    for thing in reversed(owned):
        thing.remove()


@pytest.fixture(scope="session")
def ray_cluster():
    """A real multi-node-capable Ray cluster on this machine: a head node without GPUs.

    Tests that need nodes with fake GPUs add them with ``ray_cluster.add_node(...)`` and remove
    them when done. Serve is shut down and Ray stopped at the end of the session.
    """
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 2,
            "include_dashboard": False,
            "object_store_memory": OBJECT_STORE_BYTES,
            # Workers report metrics every second, not Ray's 10: a test that waits for a counter
            # (a cancel, a stage's first series) waited 5 s on average for the next report.
            "_system_config": {"metrics_report_interval_ms": METRICS_REPORT_MS},
        },
    )
    ray.init(address=cluster.address, include_dashboard=False, log_to_driver=False)
    try:
        yield cluster
    finally:
        from ray import serve

        serve.shutdown()
        ray.shutdown()
        cluster.shutdown()
