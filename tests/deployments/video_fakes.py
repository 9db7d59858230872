"""The Videos API in-process: the real routes, store (SQLite in a temp dir) and runner, fake stages.

The fake pipeline makes frames of the asked shape from the seed, one awaited "step" at a time, so
progress, cancellation and failures can be driven without Ray; a clock the test moves drives expiry.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from dataclasses import dataclass, field

import httpx
import torch

from deployments.api.routes import build_api
from deployments.api.videos import jobs as video_jobs
from deployments.capacity.request_limits import Limits
from deployments.jobs.queue import InProcessJobQueue, JobQueueService, JobsArgs
from deployments.jobs.runner import JobRunner
from deployments.wire.spec import DenoiseProgress, GenerationSpec
from tests.deployments.fakes import FakeBoard, FakeStages, fake_config
from zoo.tiny import ensure_tiny_wan

MODEL = "tiny-wan"
LIMITS = Limits(max_width=64, max_height=64, max_steps=50, max_n=2, max_prompt_chars=200, max_frames=9,
                default_size="16x16", default_steps=2, default_frames=5, default_fps=4)


class Clock:
    def __init__(self, now: float = 1_800_000_000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


@dataclass
class FakePipeline:
    """``generate(spec, on_progress)`` as the ingress's, with knobs: step time, failures to raise."""

    step_s: float = 0.005
    failures: list = field(default_factory=list)  # exceptions raised by the next calls, in order
    calls: list = field(default_factory=list)  # request ids, one per call
    steps_run: int = 0
    gate: asyncio.Event | None = None  # when set by the test, steps wait for it

    async def __call__(self, spec: GenerationSpec, on_progress) -> torch.Tensor:
        self.calls.append(spec.request_id)
        if self.failures:
            raise self.failures.pop(0)
        for step in range(1, spec.steps + 1):
            if self.gate is not None:
                await self.gate.wait()
            await asyncio.sleep(self.step_s)
            self.steps_run += 1
            await on_progress(DenoiseProgress(spec.request_id, step, spec.steps))
        generator = torch.Generator().manual_seed(spec.seed)
        return torch.rand(spec.num_frames, spec.height, spec.width, 3, generator=generator)


@dataclass
class Harness:
    client: httpx.AsyncClient
    service: JobQueueService
    runner: JobRunner
    pipeline: FakePipeline | None
    clock: Clock

    async def wait_for(self, video_id: str, statuses=("completed", "failed"), timeout_s: float = 30) -> dict:
        deadline = asyncio.get_running_loop().time() + timeout_s
        while True:
            body = (await self.client.get(f"/v1/videos/{video_id}")).json()
            if body.get("status") in statuses or "error" in body and "status" not in body:
                return body
            assert asyncio.get_running_loop().time() < deadline, f"{video_id} still {body}"
            await asyncio.sleep(0.01)


def jobs_args(tmp_path, **overrides) -> JobsArgs:
    base = dict(directory=str(tmp_path), lease_s=3.0, poll_interval_s=0.02, replica_retry_delay_s=0.0,
                expire_after_s=600.0, poll_after_ms=50, max_running_per_ingress=4)
    base.update(overrides)
    return JobsArgs(**base)


@contextlib.asynccontextmanager
async def harness(tmp_path, token: str | None = None, pipeline: FakePipeline | None = None,
                  stages: FakeStages | None = None, board: FakeBoard | None = None, loras: tuple = (),
                  folder=None, **arg_overrides):
    """The whole HTTP API (guard, error handlers, routes) as :func:`build_api` makes it, over the
    jobs backend in-process. The runner drives ``pipeline``, or with ``stages`` the service's own
    encode -> denoise -> decode over them; ``folder``: the zoo model the API validates as (the tiny Wan)."""
    args = jobs_args(tmp_path, **arg_overrides)
    clock = Clock()
    service = JobQueueService("test-app", args)
    service.jobs.clock = clock
    pipeline = None if stages is not None else pipeline or FakePipeline()
    backend = video_jobs.JobsBackend(InProcessJobQueue(service), service.results, "test-runner", pipeline)
    # No Retry-After wait on overload: the clock is frozen (test_jobs pins the wait itself).
    config = dataclasses.replace(fake_config(token, folder=folder or ensure_tiny_wan), limits=LIMITS, jobs=args,
                                 retry_after_s=0, loras=loras)
    api = build_api(config, stages or FakeStages(), board or FakeBoard(), backend)
    jobs: video_jobs.VideoJobs = api.state.video_jobs
    jobs.clock = clock
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=api), base_url="http://test",
                                 headers=headers) as client:
        try:
            yield Harness(client, service, jobs.runner, pipeline, clock)
        finally:
            await jobs.runner.stop()
            service.close()


class CancellableStream:
    """A denoise stream with ``cancel()``, as Serve's DeploymentResponseGenerator has."""

    def __init__(self, stream, cancels: list):
        self.stream, self.cancels = stream, cancels

    def __aiter__(self):
        return self

    async def __anext__(self):
        return await self.stream.__anext__()

    def cancel(self) -> None:
        self.cancels.append(True)


@dataclass
class CancellableStages(FakeStages):
    stream_cancels: list = field(default_factory=list)

    def denoise(self, encoded, spec: GenerationSpec, progress: bool = True):
        return CancellableStream(super().denoise(encoded, spec, progress), self.stream_cancels)
