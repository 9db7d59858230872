"""One tiny-Wan service per test module that asks for it, on a free localhost port."""
from __future__ import annotations

import atexit
import os
import shutil
import tempfile

import pytest

from tests.conftest import free_port

TOKEN_ENV = "OFFLOAD_SERVE_TEST_TOKEN"
TOKEN = "test-token-1234"
APP = "svc-test"
PREFIX = "/svc"
MAX_STEPS = 200


def serve_base_url(ray_cluster) -> str:
    """Start Serve's HTTP proxy on a free localhost port, or reuse the one this session started."""
    from ray import serve
    from ray.serve.context import _get_global_client

    serve.start(http_options={"host": "127.0.0.1", "port": free_port()})
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


def tiny_args(**overrides):
    from deployments.app import AppArgs, StageArgs
    from deployments.capacity.request_limits import Limits
    from deployments.jobs.queue import JobsArgs
    from offload_core.planner.search import PerformanceMode

    # max_steps 200: room for one request long enough (~1 s of denoising here) that a replica
    # killed after its first step is surely still denoising it; every other test asks for <= 4.
    limits = Limits(max_width=64, max_height=64, max_steps=MAX_STEPS, max_n=2, max_prompt_chars=200, max_frames=9,
                    default_size="16x16", default_steps=2, default_frames=5, default_fps=4)
    # A queue of 4 per stage: the concurrency test (3 clients) fits with room for a request the
    # router still counts from the test before; the burst test (16 clients) overflows it.
    base = dict(app_name=APP, limits=limits, api_token_env=TOKEN_ENV, replica_num_cpus=0.0, device_timeout_s=1.0,
                stage_max_queued_requests=4,
                # The denoiser streams every layer (memory), so requests exercise the engine; the
                # others take the fleet profile's mode for what they got (a CPU-only node: memory).
                denoiser=StageArgs(offload_mode=PerformanceMode.MEMORY, host_memory_budget="64MiB"),
                retry_after_s=1, video_jobs=JobsArgs(directory=jobs_directory()))
    base.update(overrides)
    return AppArgs(**base)


@pytest.fixture(scope="module")
def service(ray_cluster):
    """(base url, auth headers) of the tiny Wan app; deleted when the module is done."""
    from ray import serve

    from deployments.app import build_app

    os.environ[TOKEN_ENV] = TOKEN
    base = serve_base_url(ray_cluster)
    serve.run(build_app(tiny_args()), name=APP, route_prefix=PREFIX)
    try:
        yield base + PREFIX, {"Authorization": f"Bearer {TOKEN}"}
    finally:
        from deployments.jobs.actor import drop_job_queue

        serve.delete(APP)
        drop_job_queue(APP)  # detached (it outlives replicas by design): the module's app is done
