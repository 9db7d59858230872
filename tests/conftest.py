"""Session-wide fixtures. One Ray cluster per test session, started only by tests that ask for it."""
from __future__ import annotations

import contextlib
import gc
import os
import shutil
import socket
import tempfile

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
# Workers report metrics every 3 s, not Ray's 10: a test that waits for a counter (a cancel, a stage's
# first series) waited 5 s on average for the next report. Not every 1 s: with one app up, a 1 s report
# took the idle cluster 10.95 CPU-s per 30 s against 7.71 at 3 s, log monitors off (bench/idle_app.py).
METRICS_REPORT_MS = 3000
# Every node of the tests' clusters: no log monitor (it tails every worker's log files for drivers, and the
# tests' driver takes none, log_to_driver=False): 27 CPU-s of a whole run's 1212.
QUIET_NODE = {"include_log_monitor": False}
# Serve's controller steps every 0.25 s on the tests' cluster, not every 0.1 s (Ray's default): each step
# reads every node's resources from the GCS: 0.25 s costs the idle controller and GCS 1.16 CPU-s per 30 s
# against 1.89 at 0.1 and notices a killed replica as soon; 0.5 notices it a second later. Set only while the
# head starts (its raylet hands its environment to the controller's worker), so the serve command's own head
# keeps Ray's default.
CONTROL_LOOP_ENV, CONTROL_LOOP_S = "RAY_SERVE_CONTROL_LOOP_INTERVAL_S", "0.25"
# A tmpfs, as the stores' default folder (/dev/shm/offload-serve); the system's temp folder where there is none.
SHM = "/dev/shm" if os.path.isdir("/dev/shm") else None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# The modules that run on Ray: the session's ``ray_cluster`` (checked at collection, below) or a head of
# their own (the serve command's). ``make test`` runs ``-n 2``: each group is one xdist unit, the groups
# start first, the heaviest first, so "ray" (one Ray cluster) has one worker and "serve-command" (its own
# head, no session cluster) starts on the other, the in-process tests (model logic) filling in after it.
# "ray" is the run's critical path, hence the other worker's niceness below; one cluster, not one per worker,
# because two slowed each other's tests and doubled the idle cost (docs/benchmarks.md, "The test suite's CPU").
# The figures: each module's seconds (setup + call + teardown) in a quiet run, to order the queue by.
RAY_GROUPS: dict[str, dict[str, float]] = {
    "ray": {
        # The fake-GPU fleet's package (tests/cluster: its three nodes are started once per cluster).
        "tests/cluster/ledger/test_actor.py": 49.8, "tests/cluster/ledger/test_shared_stores.py": 26.9,
        "tests/cluster/test_autoscale.py": 24.1, "tests/cluster/replica/test_ledger_view.py": 18.1,
        "tests/cluster/replica/test_plan.py": 9.5, "tests/cluster/replica/test_device_leases.py": 5.6,
        "tests/cluster/replica/test_neighbours.py": 4.8,
        "tests/deployments/capacity/test_limits_service.py": 48.2,
        "tests/deployments/ingress/test_health_service.py": 16.2, "tests/test_ray_fixture.py": 4.0,
        # The service's apps; the shared app's modules (tests/deployments/conftest.py) in one group, else two
        # clusters would each deploy it.
        "tests/deployments/ingress/test_service.py": 29.0, "tests/deployments/ingress/test_video_jobs_service.py": 57.1,
        "tests/deployments/ingress/test_service_lifecycle.py": 51.4,
        "tests/deployments/replica/test_tensor_parallel_service.py": 46.3,
        "tests/deployments/ingress/test_families_service.py": 26.6, "tests/deployments/replica/tensor_parallel/test_group.py": 21.1,
        "tests/deployments/ingress/test_service_sd3.py": 19.7,
        # Two stand-in Denoisers on two sim GPU nodes: the predicted-finish router as Serve runs it.
        "tests/deployments/routing/test_routing_service.py": 45.7,
    },  # 458.4 s
    "serve-command": {"tests/deployments/dev/test_serve_command.py": 67.5},
}
RAY_MODULES = frozenset(module for group in RAY_GROUPS.values() for module in group)


def ray_group(module: str) -> str | None:
    """The Ray group of a test module (its path from the repository root), None for an in-process one."""
    return next((name for name, modules in RAY_GROUPS.items() if module in modules), None)


def pytest_collection_modifyitems(config, items):
    """A module that uses the session's Ray cluster must be in one Ray group (else it would run beside the
    groups and start a third cluster); no module is in two, and every one listed exists."""
    twice = sorted(m for m in RAY_MODULES if sum(m in group for group in RAY_GROUPS.values()) > 1)
    if twice:
        raise pytest.UsageError(f"tests/conftest.py: {twice} in more than one of RAY_GROUPS")
    gone = sorted(m for m in RAY_MODULES | set(LONG_IN_PROCESS) if not (config.rootpath / m).is_file())
    if gone:
        raise pytest.UsageError(f"tests/conftest.py: RAY_GROUPS or LONG_IN_PROCESS lists {gone}, which do not exist")
    missing = sorted({item.nodeid.split("::")[0] for item in items if "ray_cluster" in item.fixturenames}
                     - RAY_MODULES)
    if missing:
        raise pytest.UsageError(f"tests/conftest.py: add {missing} to one of RAY_GROUPS (they use ray_cluster)")


# The xdist worker that does not run the session cluster's group (the serve command's module, then in-process
# modules) runs at nice 15, so that group (the critical path) gets the CPU when it wants it and the rest takes
# what it leaves. Ray starts its own workers (Serve's replicas and controller, every actor) at nice 15 too, so
# the in-process tests share the cores evenly with the replicas; of nice 0, 10, 15, 19 and SCHED_IDLE, 15 ended
# whole runs soonest with both workers done together (docs/benchmarks.md, "The suite's runs after 06:00").
IN_PROCESS_NICE = 15
CRITICAL_GROUP = max(RAY_GROUPS, key=lambda name: sum(RAY_GROUPS[name].values()))
# The in-process modules that take longest (seconds, a quiet run): first in the queue after the Ray groups, the
# longest first, so the run does not end on one worker with a 25 s module while the other idles (xdist queues
# by tests per module: one-test modules came last).
LONG_IN_PROCESS: dict[str, float] = {
    "tests/deployments/models/test_conformance.py": 37.5, "tests/bench/test_gpu_check.py": 25.1,
    "tests/deployments/api/test_http_properties.py": 15.8, "tests/deployments/api/videos/test_jobs_properties.py": 14.2,
    "tests/deployments/replica/test_step_cache_batching.py": 13.9, "tests/offload_core/planner/test_skeletons.py": 13.6,
    "tests/deployments/models/test_activation_features.py": 11.6, "tests/deployments/replica/tensor_parallel/test_ranked_denoiser.py": 8.8,
    "tests/offload_core/planner/test_cli.py": 8.3, "tests/bench/test_sim_overlap.py": 7.9,
    "tests/deployments/replica/test_warmup.py": 7.5, "tests/offload_core/planner/test_search.py": 6.6,
    "tests/offload_core/residency/test_host_tables.py": 6.2, "tests/bench/test_gpu_activations.py": 10.0,
}


def pytest_collection_finish(session):
    """Freeze what collection made (torch, diffusers, transformers, Ray and every test module: ~0.5 M
    objects), so a full collection walks only what the tests make after it (docs/benchmarks.md, "Freezing
    what test collection made"). Nothing a test made is frozen: no test has run yet, and collected garbage
    goes first."""
    gc.collect()
    gc.freeze()


def pytest_runtest_setup(item):
    """A test outside :data:`CRITICAL_GROUP` in an xdist worker: the worker (and what it starts from now on,
    the serve command's Ray head among them) yields the CPU to that group's cluster."""
    if os.environ.get("PYTEST_XDIST_WORKER") and ray_group(item.nodeid.split("::")[0]) != CRITICAL_GROUP:
        niceness = os.nice(0)
        if niceness < IN_PROCESS_NICE:
            os.nice(IN_PROCESS_NICE - niceness)


# optionalhook: without pytest-xdist (the GPU machine's image: bench/gpu_check.py runs the CUDA tests in one
# process) pluggy refuses an unknown hook at collection, and no test runs.
@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """pytest-xdist's scheduler with each Ray group one unit (its ``xdist_group`` mark does not group under
    pytest 9.2: xdist 3.8 renames ``item._nodeid``, which pytest 9 no longer reads) and each in-process
    module one unit (its module fixtures and the process's caches are built on one worker, not on both);
    the groups first in the queue, the heaviest first, so they start at once on the first two workers and
    the in-process modules fill in wherever a worker is free, the long ones (:data:`LONG_IN_PROCESS`) first."""
    from xdist.scheduler import LoadScopeScheduling

    class RayGroupsFirst(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::")[0]
            return ray_group(module) or module

        def _assign_work_unit(self, node) -> None:
            # xdist orders its queue by tests per unit (unless --no-loadscope-reorder): an in-process
            # module with more tests than a group would come first, and both groups then on one worker.
            if not getattr(self, "_groups_first", False):  # the queue is complete by the first assignment
                self._groups_first = True
                first = [*sorted(RAY_GROUPS, key=lambda g: -sum(RAY_GROUPS[g].values())),
                         *sorted(LONG_IN_PROCESS, key=lambda m: -LONG_IN_PROCESS[m])]
                for name in reversed(first):
                    if name in self.workqueue:
                        self.workqueue.move_to_end(name, last=False)
            super()._assign_work_unit(node)

    return RayGroupsFirst(config, log)


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

    One per xdist worker, and other clusters may run on this machine meanwhile (the other worker's, a
    helper's): every port is one the kernel picks (Ray's dashboard agent would take its fixed 52365, and
    a second head's agent then served no HTTP), and the node weight stores (offload_core/shared_store/files.py)
    live in a folder of this cluster's own, since a store's file name is the digest of what it holds: two
    clusters serving the tiny Wan would name the same file, and each one's ledger removes it when its own
    last replica leaves.
    """
    with local_cluster() as cluster:
        yield cluster


@contextlib.contextmanager
def local_cluster():
    """The tests' Ray cluster (what :func:`ray_cluster` yields), connected to; Serve and Ray stopped and
    the stores' folder removed at the exit. Also bench/idle_app.py's, so it measures what the tests run."""
    import ray
    from ray.cluster_utils import Cluster

    from offload_core.shared_store.files import STORE_DIR_ENV

    # Set before the head starts: its raylet passes its environment to every worker it starts.
    stores = tempfile.mkdtemp(prefix="offload-serve-test-stores-", dir=SHM)
    os.environ[STORE_DIR_ENV] = stores
    loop_s = os.environ.get(CONTROL_LOOP_ENV)
    os.environ[CONTROL_LOOP_ENV] = loop_s or CONTROL_LOOP_S
    try:  # the folder goes also when the head fails to start
        try:
            cluster = Cluster(
                initialize_head=True,
                head_node_args={
                    "num_cpus": 2,
                    "include_dashboard": False,
                    "dashboard_agent_listen_port": 0,
                    "object_store_memory": OBJECT_STORE_BYTES,
                    **QUIET_NODE,
                    "_system_config": {"metrics_report_interval_ms": METRICS_REPORT_MS},
                },
            )
        finally:
            if loop_s is None:
                del os.environ[CONTROL_LOOP_ENV]
        ray.init(address=cluster.address, include_dashboard=False, log_to_driver=False)
        try:
            yield cluster
        finally:
            from ray import serve

            serve.shutdown()
            ray.shutdown()
            cluster.shutdown()
    finally:
        shutil.rmtree(stores, ignore_errors=True)
