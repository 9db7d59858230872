"""The job runner's wait for work: a job queued through any replica, or falling due, is claimed at once by an
idle runner however long its poll interval, and an idle runner calls its queue once per poll interval."""
from __future__ import annotations

import asyncio
import threading
import time

from deployments.jobs.queue import InProcessJobQueue, JobQueueService, JobsArgs
from deployments.jobs.records import new_job, new_job_id
from deployments.jobs.runner import JobRunner
from deployments.wire.failures import Failure, FailureKind
from tests.deployments.jobs.test_records import PARAMS

LONG_POLL_S = 30.0  # longer than any test here: a claim it waited for would fail the test


class CountingQueue(InProcessJobQueue):
    """The in-process queue, counting its calls by method."""

    def __init__(self, service: JobQueueService):
        super().__init__(service)
        self.calls: dict[str, int] = {}

    async def _call(self, method: str, *args):
        self.calls[method] = self.calls.get(method, 0) + 1
        return await super()._call(method, *args)

    async def wait_for_work(self, wait_s):  # the in-process queue's own thread, not _call
        self.calls["wait_for_work"] = self.calls.get("wait_for_work", 0) + 1
        return await super().wait_for_work(wait_s)


def _runner(tmp_path, poll_interval_s: float = LONG_POLL_S):
    args = JobsArgs(directory=str(tmp_path), poll_interval_s=poll_interval_s, lease_s=60.0)
    service = JobQueueService("app", args)
    queue, started = CountingQueue(service), []

    async def generate(spec, on_progress):
        started.append((spec.request_id, time.monotonic()))
        await asyncio.Event().wait()  # runs until the runner stops

    runner = JobRunner(queue, service.results, generate, "runner-a", args, 0.0, lambda e: Failure(FailureKind.OTHER, e))
    return service, queue, runner, started


def _queue_elsewhere(service: JobQueueService) -> tuple[str, float]:
    """A job queued through another replica (this runner is not woken), from another thread: (id, when)."""
    job = new_job(new_job_id(time.time()), "m", PARAMS, int(time.time()))
    done = threading.Event()
    threading.Thread(target=lambda: (service.create(job), done.set())).start()
    done.wait(5)
    return job.id, time.monotonic()


async def _until(predicate, timeout_s: float = 10.0):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline
        await asyncio.sleep(0.01)


def test_a_job_queued_through_another_replica_is_claimed_at_once_by_an_idle_runner(tmp_path):
    service, _, runner, started = _runner(tmp_path)

    async def run():
        assert runner.start()
        await asyncio.sleep(0.3)  # idle, waiting for work
        job_id, queued_at = _queue_elsewhere(service)
        await _until(lambda: started)
        await runner.stop()
        return job_id, queued_at

    job_id, queued_at = asyncio.run(run())
    assert started[0][0] == job_id
    assert started[0][1] - queued_at < 2.0, "claimed at the next poll, not when it was queued"


def test_a_job_put_back_with_a_delay_is_claimed_when_the_delay_ends(tmp_path):
    service, _, runner, started = _runner(tmp_path)
    job_id, _ = _queue_elsewhere(service)
    (claimed,) = service.claim("runner-b", 1)
    service.put_back(job_id, claimed.owner, "queue full", counted=False, delay_s=0.5)
    put_back_at = time.monotonic()

    async def run():
        assert runner.start()
        await _until(lambda: started)
        await runner.stop()

    asyncio.run(run())
    assert 0.45 <= started[0][1] - put_back_at < 2.0, "claimed when its delay ended, not at the next poll"


def test_an_idle_runner_calls_its_queue_once_per_poll_interval(tmp_path):
    _, queue, runner, _ = _runner(tmp_path, poll_interval_s=0.25)

    async def run():
        assert runner.start()
        await asyncio.sleep(1.5)
        await runner.stop()

    asyncio.run(run())
    looks = 1.5 / 0.25
    # Each look: one claim and one wait for work (the first also sweeps expired jobs).
    assert queue.calls["claim"] <= looks + 2 and queue.calls["wait_for_work"] <= looks + 2, queue.calls


def test_a_wait_for_work_in_progress_when_the_queue_closes_answers_false_without_touching_the_closed_file(tmp_path):
    service = JobQueueService("app", JobsArgs(directory=str(tmp_path), lease_s=60.0))
    answers, errors = [], []

    def wait() -> None:
        try:
            answers.append(service.wait_for_work(LONG_POLL_S))
        except Exception as exc:  # the closed SQLite file, read by a wait the close did not end
            errors.append(exc)

    waiter = threading.Thread(target=wait)
    waiter.start()
    time.sleep(0.2)  # the wait is under way, nothing queued
    started = time.monotonic()
    service.close()
    waiter.join(5)
    # A wait the close did not end runs its 30 s; a third of it leaves room for a preempted worker.
    assert not waiter.is_alive() and time.monotonic() - started < LONG_POLL_S / 3, "the close did not end the wait"
    assert (answers, errors) == ([False], [])
