"""The SQLite job table: claims and leases, the one retry, restarts of the service, expiry, cursors."""
from __future__ import annotations

from deployments.jobs.records import (
    MAX_ATTEMPTS,
    JobParams,
    JobStatus,
    ListOrder,
    SqliteJobQueue,
    new_job,
    new_job_id,
)
from tests.deployments.video_fakes import Clock

PARAMS = JobParams("a fox", None, 16, 16, 5, 4, 2, 5.0, 1, "1")


def _store(tmp_path, clock) -> SqliteJobQueue:
    return SqliteJobQueue(tmp_path / "jobs.sqlite3", expire_after_s=100, lease_s=10, clock=clock)


def _add(store: SqliteJobQueue, clock: Clock):
    clock.now += 0.001  # ids carry the creation time in microseconds
    return store.create(new_job(new_job_id(clock()), "m", PARAMS, int(clock())))


def test_jobs_running_when_the_service_stopped_are_queued_again_when_the_file_is_reopened(tmp_path):
    clock = Clock()
    store = _store(tmp_path, clock)
    running, waiting = _add(store, clock), _add(store, clock)
    assert [j.id for j in store.claim("runner-a", 1)] == [running.id]
    store.close()
    reopened = _store(tmp_path, clock)
    assert reopened.get(running.id).status is JobStatus.QUEUED and reopened.get(running.id).attempts == 1
    assert reopened.get(waiting.id).status is JobStatus.QUEUED
    (rerun, _) = reopened.claim("runner-b", 2)
    assert (rerun.id, rerun.attempts) == (running.id, 2), "the rerun is its one retry"
    reopened.close()
    last = _store(tmp_path, clock)  # stopped again during its retry: no third run
    failed = last.get(running.id)
    assert failed.status is JobStatus.FAILED and failed.error.code == "retries_exhausted"
    assert "service stopped" in failed.error.message


def test_jobs_are_claimed_in_the_order_they_were_queued_even_when_their_ids_sort_the_other_way(tmp_path):
    clock = Clock()
    store = _store(tmp_path, clock)
    # One microsecond, or a replica whose clock is behind: the ids sort against the queue's order.
    later_id, earlier_id = new_job_id(clock()), new_job_id(clock() - 1)
    for job_id in (later_id, earlier_id):
        store.create(new_job(job_id, "m", PARAMS, int(clock())))
    assert [j.id for j in store.claim("runner", 1)] == [later_id], "first queued, first run"
    assert [j.id for j in store.claim("runner", 1)] == [earlier_id]


def test_a_lapsed_lease_requeues_the_job_and_only_the_holder_may_finish_it(tmp_path):
    clock = Clock()
    store = _store(tmp_path, clock)
    job = _add(store, clock)
    (first,) = store.claim("runner-a", 1)
    assert first.owner == "runner-a/1", "a lease names its runner and attempt"
    clock.now += 5
    assert store.renew(((job.id, first.owner),), {job.id: 40}) == {job.id}
    assert store.get(job.id).progress == 40
    clock.now += 11
    (again,) = store.claim("runner-a", 1)  # the same runner, its loop stalled past the lease
    assert (again.id, again.attempts, again.progress, again.owner) == (job.id, 2, 0, "runner-a/2")
    assert store.renew(((job.id, first.owner),), {}) == frozenset(), "the stale attempt learns it lost the job"
    assert not store.complete(job.id, first.owner, f"{job.id}-1")
    assert store.complete(job.id, again.owner, f"{job.id}-2")
    done = store.get(job.id)
    assert (done.status, done.progress, done.result_key) == (JobStatus.COMPLETED, 100, f"{job.id}-2")
    assert done.expires_at == done.completed_at + 100


def test_overload_does_not_use_up_the_retry_and_waits_before_the_next_claim(tmp_path):
    clock = Clock()
    store = _store(tmp_path, clock)
    job = _add(store, clock)
    for _ in range(MAX_ATTEMPTS + 1):
        (claimed,) = store.claim("runner", 1)
        back = store.put_back(job.id, claimed.owner, "queue full", counted=False, delay_s=2)
        assert (back.status, back.attempts) == (JobStatus.QUEUED, 0)
        assert store.claim("runner", 1) == (), "claimable only after the delay"
        clock.now += 2
    (claimed,) = store.claim("runner", 1)
    assert store.put_back(job.id, claimed.owner, "replica lost", counted=True, delay_s=0).status is JobStatus.QUEUED
    (claimed,) = store.claim("runner", 1)
    failed = store.put_back(job.id, claimed.owner, "replica lost", counted=True, delay_s=0)
    assert failed.status is JobStatus.FAILED and "replica lost" in failed.error.message


def test_expiry_removes_finished_jobs_past_their_time_only(tmp_path):
    clock = Clock()
    store = _store(tmp_path, clock)
    done, queued = _add(store, clock), _add(store, clock)
    (claimed,) = store.claim("runner", 1)
    store.complete(done.id, claimed.owner, f"{done.id}-1")
    clock.now += 99
    assert store.expire() == ()
    clock.now += 1
    assert [j.id for j in store.expire()] == [done.id]
    assert store.get(done.id) is None and store.get(queued.id) is not None, "queued jobs never expire"


def test_a_cursor_still_pages_after_its_job_was_deleted(tmp_path):
    clock = Clock()
    store = _store(tmp_path, clock)
    ids = [_add(store, clock).id for _ in range(5)]
    first = store.list(None, 2, ListOrder.ASC)
    assert [j.id for j in first.jobs] == ids[:2] and first.has_more
    store.delete(ids[1])
    rest = store.list(ids[1], 10, ListOrder.ASC)
    assert [j.id for j in rest.jobs] == ids[2:] and not rest.has_more
    assert [j.id for j in store.list(ids[3], 10, ListOrder.DESC).jobs] == [ids[2], ids[0]]


def test_due_in_says_when_a_claim_could_next_get_a_job(tmp_path):
    clock = Clock()
    store = _store(tmp_path, clock)
    assert store.due_in() is None, "nothing queued or running: nothing falls due"
    job = _add(store, clock)
    assert store.due_in() == 0.0
    (claimed,) = store.claim("runner", 1)
    assert abs(store.due_in() - 10.001) < 1e-6, "the lease lapses after 10 s, and is reclaimed just past it"
    store.put_back(job.id, claimed.owner, "queue full", counted=False, delay_s=2)
    assert abs(store.due_in() - 2) < 1e-6, "put back for 2 s"
    clock.now += 2
    assert store.due_in() == 0.0 and store.claim("runner", 1)
    clock.now += 10.5
    assert store.due_in() == 0.0, "its lease lapsed: a claim would queue it again and take it"
