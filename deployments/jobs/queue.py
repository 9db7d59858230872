"""One job queue per application: the SQLite table and the results together, and the Protocol the ingress sees.

No Ray here: the ingress and the runner see the queue through the :class:`JobQueue` Protocol, bound
in a Serve ingress replica to the application's queue actor (:mod:`deployments.jobs.actor`, which runs
:class:`JobQueueService` in its own process on the head node) and in tests to
:class:`InProcessJobQueue` (the same SQLite code in the test's process).
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import pathlib
import threading
import time
from typing import Protocol

from pydantic import BaseModel, ConfigDict, Field

from deployments.jobs.records import JobError, JobPage, ListOrder, SqliteJobQueue, VideoJob
from deployments.jobs.results import ResultFolder

logger = logging.getLogger(__name__)


class JobsArgs(BaseModel):
    """``args.video_jobs`` in the Serve config: where jobs and results live and how they are run."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # The SQLite file is <directory>/<app_name>.sqlite3 on the head node (where the queue runs).
    directory: str = "~/.cache/offload-serve/jobs"
    # A directory or fsspec URL every ingress replica reaches; None: <directory>/<app_name>-results.
    results_url: str | None = None
    # Finished jobs (and their mp4s) are deleted this long after they finish: a day, like OpenAI's.
    expire_after_s: float = Field(86400.0, gt=0)
    # A runner renews its jobs' leases every lease_s / 3; a job whose lease lapses (its ingress
    # replica died) is queued again. 30 s: three missed renewals of a replica's event loop.
    lease_s: float = Field(30.0, gt=0)
    # Jobs one ingress replica runs at once. A Wan job keeps the Denoiser busy for minutes; 4 lets
    # the encoder and decoder of the next jobs overlap it without filling the stage queues (16).
    max_running_per_ingress: int = Field(4, ge=1)
    # A job whose stage replica was lost waits this long before its retry, so Serve has noticed the
    # loss (about 1-2 s here) and routes the retry to the replacement rather than the dead replica.
    replica_retry_delay_s: float = Field(5.0, ge=0)
    # The longest an idle runner's wait for work lasts before it looks again (and it sweeps expired jobs
    # every 20th look); also its pause after a failed queue call. The queue answers the wait as soon as a
    # job is queued or put back through any replica, or is due (a retry's delay, a lapsed lease), so this
    # bounds only what the queue's clock does not tell it. Each look is an actor call: at 0.2 s an idle
    # runner and its queue spent 0.85 CPU-s per 30 s (bench/idle_app.py).
    poll_interval_s: float = Field(5.0, gt=0)
    # The poll interval suggested to clients (the openai client reads openai-poll-after-ms).
    poll_after_ms: int = Field(1000, ge=10)

    def db_path(self, app_name: str) -> pathlib.Path:
        return pathlib.Path(self.directory).expanduser().resolve() / f"{app_name}.sqlite3"

    def results_location(self, app_name: str) -> str:
        if self.results_url is not None:
            return self.results_url
        return str(pathlib.Path(self.directory).expanduser().resolve() / f"{app_name}-results")


class JobQueueService:
    """The table and the results together: deleting or expiring a job deletes its files too."""

    def __init__(self, app_name: str, args: JobsArgs):
        self.jobs = SqliteJobQueue(args.db_path(app_name), args.expire_after_s, args.lease_s)
        self.results = ResultFolder(args.results_location(app_name))
        self._work = threading.Condition()  # notified when a job is queued or put back, or the queue closes
        self._closed = False
        logger.info("job queue for %s: %s, results in %s, expiry %g s, lease %g s", app_name, self.jobs.path,
                    self.results.url, args.expire_after_s, args.lease_s)

    def _queued(self) -> None:
        with self._work:
            self._work.notify_all()

    def close(self) -> None:
        """Close the table; a wait for work in progress answers False (it read the closed file before)."""
        with self._work:
            self._closed = True
            self._work.notify_all()
        self.jobs.close()

    def wait_for_work(self, wait_s: float) -> bool:
        """True as soon as a claim could get a job (one is queued and due, or a lease lapsed); False after
        ``wait_s`` without one, or once the queue is closed. Answers a runner's wait for work (it claims
        next); never claims itself, so a runner that died while waiting takes no job with it."""
        deadline = time.monotonic() + wait_s
        with self._work:
            while True:
                if self._closed:
                    return False
                due_in = self.jobs.due_in()
                if due_in == 0.0:
                    return True
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._work.wait(left if due_in is None else min(left, due_in))

    def create(self, job: VideoJob) -> VideoJob:
        created = self.jobs.create(job)
        self._queued()
        return created

    def get(self, job_id: str) -> VideoJob | None:
        return self.jobs.get(job_id)

    def list(self, after: str | None, limit: int, order: ListOrder) -> JobPage:
        return self.jobs.list(after, limit, order)

    def claim(self, owner: str, limit: int) -> tuple[VideoJob, ...]:
        return self.jobs.claim(owner, limit)

    def renew(self, leases: tuple[tuple[str, str], ...], progress: dict[str, int]) -> frozenset[str]:
        return self.jobs.renew(leases, progress)

    def complete(self, job_id: str, owner: str, result_key: str) -> bool:
        return self.jobs.complete(job_id, owner, result_key)

    def fail(self, job_id: str, owner: str, error: JobError) -> bool:
        return self.jobs.fail(job_id, owner, error)

    def put_back(self, job_id: str, owner: str, reason: str, counted: bool, delay_s: float) -> VideoJob | None:
        job = self.jobs.put_back(job_id, owner, reason, counted, delay_s)
        self._queued()
        return job

    def delete(self, job_id: str) -> VideoJob | None:
        job = self.jobs.delete(job_id)
        if job is not None:
            self._delete_files(job)
        return job

    def expire(self) -> int:
        expired = self.jobs.expire()
        files = sum(self._delete_files(job) for job in expired)
        if expired:
            logger.info("expired %d job(s), deleted %d result file(s)", len(expired), files)
        return len(expired)

    def _delete_files(self, job: VideoJob) -> int:
        """The job's result files and its source video (an edit's or an extension's): how many there were."""
        files = 0 if job.result_key is None else self.results.delete(job.result_key)
        return files + (self.results.delete_source(job.id) if job.params.source_video else 0)


class JobQueue(Protocol):
    """What the ingress needs from the queue; every method is one SQLite transaction."""

    async def create(self, job: VideoJob) -> VideoJob: ...
    async def get(self, job_id: str) -> VideoJob | None: ...
    async def list(self, after: str | None, limit: int, order: ListOrder) -> JobPage: ...
    async def claim(self, owner: str, limit: int) -> tuple[VideoJob, ...]: ...
    async def renew(self, leases: tuple[tuple[str, str], ...], progress: dict[str, int]) -> frozenset[str]: ...
    async def complete(self, job_id: str, owner: str, result_key: str) -> bool: ...
    async def fail(self, job_id: str, owner: str, error: JobError) -> bool: ...
    async def put_back(self, job_id: str, owner: str, reason: str, counted: bool, delay_s: float
                       ) -> VideoJob | None: ...
    async def delete(self, job_id: str) -> VideoJob | None: ...
    async def expire(self) -> int: ...
    async def wait_for_work(self, wait_s: float) -> bool: ...


class AsyncJobQueue:
    """The :class:`JobQueue` methods, each forwarded to ``_call``."""

    async def _call(self, method: str, *args):
        raise NotImplementedError

    async def create(self, job):
        return await self._call("create", job)

    async def get(self, job_id):
        return await self._call("get", job_id)

    async def list(self, after, limit, order):
        return await self._call("list", after, limit, order)

    async def claim(self, owner, limit):
        return await self._call("claim", owner, limit)

    async def renew(self, leases, progress):
        return await self._call("renew", leases, progress)

    async def complete(self, job_id, owner, result_key):
        return await self._call("complete", job_id, owner, result_key)

    async def fail(self, job_id, owner, error):
        return await self._call("fail", job_id, owner, error)

    async def put_back(self, job_id, owner, reason, counted, delay_s):
        return await self._call("put_back", job_id, owner, reason, counted, delay_s)

    async def delete(self, job_id):
        return await self._call("delete", job_id)

    async def expire(self):
        return await self._call("expire")

    async def wait_for_work(self, wait_s):
        return await self._call("wait_for_work", wait_s)


class InProcessJobQueue(AsyncJobQueue):
    """The same queue in this process (tests; a single-process run). SQLite calls go off the loop."""

    def __init__(self, service: JobQueueService):
        self.service = service

    async def _call(self, method: str, *args):
        return await asyncio.to_thread(getattr(self.service, method), *args)

    async def wait_for_work(self, wait_s):
        """In a daemon thread of its own, not the loop's executor: a wait the runner abandons when it stops
        would hold ``asyncio.run``'s exit (which joins that executor) for the rest of ``wait_s``."""
        loop, answer = asyncio.get_running_loop(), asyncio.Event()
        result: list[bool] = []

        def wait() -> None:
            result.append(self.service.wait_for_work(wait_s))
            with contextlib.suppress(RuntimeError):  # the loop closed while this waited: nobody is waiting
                loop.call_soon_threadsafe(answer.set)

        threading.Thread(target=wait, name="wait-for-work", daemon=True).start()
        await answer.wait()
        return result[0]
