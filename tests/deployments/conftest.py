"""The tiny-Wan service on a free localhost port: one app for the session's modules that serve it as
configured here (ingress/test_service.py, ingress/test_video_jobs_service.py), which run one after
another, in one Ray group (tests/conftest.py), and leave it as they found it; a module that changes
the config deploys an app of its own."""
from __future__ import annotations

import atexit
import os
import pathlib
import shutil
import tempfile

import pytest

from tests.conftest import free_port, ray_group

TOKEN_ENV = "OFFLOAD_SERVE_TEST_TOKEN"
TOKEN = "test-token-1234"
APP = "svc-test"
PREFIX = "/svc"
MAX_STEPS = 1000


def serve_base_url(ray_cluster) -> str:
    """Start Serve's HTTP proxy on a free localhost port, or reuse the one this session started."""
    from ray import serve
    from ray.serve.context import _get_global_client

    # One proxy, on the head (the tests' requests go there), not one more on every fake GPU node a
    # replica lands on: each started in 5+ s on a loaded machine for no request.
    serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": free_port()})
    config = _get_global_client().http_config
    return f"http://{config.host}:{config.port}"


def jobs_directory() -> str:
    """One temporary folder per test session for the apps' job queues (SQLite files, results)."""
    global _JOBS_DIR
    if _JOBS_DIR is None:
        _JOBS_DIR = tempfile.mkdtemp(prefix="offload-serve-test-jobs-")
        atexit.register(shutil.rmtree, _JOBS_DIR, True)
    return _JOBS_DIR


_JOBS_DIR: str | None = None


REPLICA_NICENESS = 14


def tiny_args(**overrides):
    from deployments.app import AppArgs, StageArgs
    from deployments.capacity.request_limits import Limits
    from deployments.jobs.queue import JobsArgs
    from offload_core.planner.search import PerformanceMode

    # max_steps 1000: room for requests long enough (~5 s of denoising here) that a replica killed
    # after its first step is surely still denoising, and that a client giving up after 1 s leaves
    # mid-denoise (ingress/test_service_lifecycle.py); every other test asks for <= 4.
    limits = Limits(max_width=64, max_height=64, max_steps=MAX_STEPS, max_n=2, max_prompt_chars=200, max_frames=9,
                    default_size="16x16", default_steps=2, default_frames=5, default_fps=4)
    # A queue of 4 per stage: the concurrency test (3 clients) fits with room for a request the
    # router still counts from the test before; the burst test (16 clients) overflows it.
    # Replicas at nice 14, not the service's 0: the suite balances its in-process worker (nice 15,
    # tests/conftest.py) against replicas at Ray's own 15, and a value of its own (not 15) shows the
    # option reaching the replicas (test_service's log test).
    base = dict(app_name=APP, limits=limits, api_token_env=TOKEN_ENV, replica_num_cpus=0.0, device_timeout_s=1.0,
                stage_max_queued_requests=4, replica_niceness=REPLICA_NICENESS,
                # The denoiser streams every layer (memory), so requests exercise the engine; the
                # others take the fleet profile's mode for what they got (a CPU-only node: memory).
                denoiser=StageArgs(offload_mode=PerformanceMode.MEMORY, host_memory_budget="64MiB"),
                retry_after_s=1, video_jobs=JobsArgs(directory=jobs_directory()))
    base.update(overrides)
    return AppArgs(**base)


# The shared app's video jobs: a 10 s lease (a loaded 2-core machine can stall a replica's loop for
# seconds); a job whose replica died is rerun after 3 s. Queued jobs are picked up at once at the default
# poll interval (the queue wakes its runner); a 0.2 s poll cost 0.85 CPU-s per 30 s of the idle app.
SHARED_JOBS = dict(lease_s=10.0, poll_after_ms=100, replica_retry_delay_s=3.0)


# The shared app serves one LoRA adapter (a random rank-4 one for the tiny Wan's attention and
# feed-forward Linears), so a request naming it crosses the real ingress, Ray and the Denoiser.
SHARED_LORA = "ink"


def shared_lora_file() -> str:
    """The shared adapter's file, written once per session next to the job queues (seeded: the same bytes)."""
    from diffusers import WanTransformer3DModel

    from tests.deployments.models.lora_files import write_adapter
    from zoo.tiny import ensure_tiny_wan

    path = pathlib.Path(jobs_directory()) / "loras" / f"{SHARED_LORA}.safetensors"
    if not path.exists():
        transformer = WanTransformer3DModel.from_pretrained(ensure_tiny_wan(), subfolder="transformer")
        write_adapter(transformer, path, rank=4, seed=11, strength=4.0)
    return str(path)


def shared_args():
    """The shared app's arguments: :func:`tiny_args` with :data:`SHARED_JOBS` and :data:`SHARED_LORA`."""
    from deployments.jobs.queue import JobsArgs

    return tiny_args(video_jobs=JobsArgs(directory=jobs_directory(), **SHARED_JOBS),
                     lora_adapters=[{"name": SHARED_LORA, "path": shared_lora_file(), "scale": 1.0,
                                     "families": ["wan"]}])


# Serve health-checks the replicas the video jobs tests kill (the ingress, a Denoiser) every second, not
# every 10 s (its default): the controller learns of a killed replica only at its next check, and that
# wait was 7-8 s of each of those tests. No test kills the others: a check a second costs the controller
# and the replica CPU while the app idles.
SHARED_OPTIONS = {name: {"health_check_period_s": 1.0} for name in ("Denoiser", "Ingress")}


def deploy_shared() -> None:
    """(Re)deploy the shared app: what a restart of the whole application deploys again."""
    from ray import serve

    from deployments.app import build_app_with

    serve.run(build_app_with(shared_args(), SHARED_OPTIONS), name=APP, route_prefix=PREFIX)


_SHARED = {"deployed": False}


def ensure_shared() -> None:
    """Deploy the shared app unless it runs (at its first user, or after :func:`delete_shared`)."""
    if not _SHARED["deployed"]:
        deploy_shared()
        _SHARED["deployed"] = True


def delete_app(name: str) -> None:
    """Delete a test's app and its job queue (detached: it outlives the app's replicas by design)."""
    from ray import serve

    from deployments.jobs.actor import drop_job_queue

    serve.delete(name)
    drop_job_queue(name)


def delete_shared() -> None:
    """Delete the shared app (:func:`delete_app`) once it is deployed."""
    if not _SHARED["deployed"]:
        return
    _SHARED["deployed"] = False
    delete_app(APP)


@pytest.fixture(scope="session")
def shared_service(ray_cluster):
    """(base url, auth headers) of the shared tiny-Wan app; deleted after its last user
    (:func:`pytest_runtest_teardown`), at the latest when the session ends."""
    os.environ[TOKEN_ENV] = TOKEN
    try:
        yield serve_base_url(ray_cluster) + PREFIX, {"Authorization": f"Bearer {TOKEN}"}
    finally:
        delete_shared()


@pytest.fixture(scope="module")
def service(shared_service):
    """(base url, auth headers) of the shared tiny-Wan app, deployed if it is not running."""
    ensure_shared()
    return shared_service


def _uses_shared(item) -> bool:
    return "shared_service" in getattr(item, "fixturenames", ())


def pytest_collection_modifyitems(items):
    """The modules of the shared app run one after another, from where the first one stood (every other
    test keeps its order): the app is deployed once, not once per module, and is idle for no other test."""
    users = [item for item in items if _uses_shared(item)]
    if not users:
        return
    groups = {module: ray_group(module) for module in {item.nodeid.split("::")[0] for item in users}}
    if len(set(groups.values())) > 1:
        raise pytest.UsageError(f"tests/conftest.py: the shared app's modules must be in one Ray group, not {groups}")
    first = items.index(users[0])
    others = [item for item in items if not _uses_shared(item)]
    items[:] = others[:first] + users + others[first:]


def pytest_runtest_teardown(item, nextitem):
    """After the shared app's last user: delete it (its replicas would idle through every later test)."""
    if _uses_shared(item) and (nextitem is None or not _uses_shared(nextitem)):
        delete_shared()
