"""Video jobs: their records and the SQLite table that holds them (one file per application).

Pure Python and ``sqlite3``: no Ray here. :mod:`deployments.jobs.actor` puts one
:class:`SqliteJobQueue` behind one named actor per application, so every ingress replica sees the
same jobs, and the file outlives the actor, the replicas and ``serve run`` itself.

A job is claimed by one runner (an ingress replica) under a lease that the runner renews while it
works; a lease that runs out (the replica died) puts the job back in the queue. Every claim is an
attempt; a job gets :data:`MAX_ATTEMPTS` (its first run and one retry) before it fails with a reason.
"""
from __future__ import annotations

import contextlib
import enum
import json
import logging
import os
import pathlib
import secrets
import sqlite3
import threading
import time
from dataclasses import asdict, dataclass
from typing import Callable, Iterator

logger = logging.getLogger(__name__)

# The first run and one retry: a job is rerun once after its replica died or the service stopped.
MAX_ATTEMPTS = 2


class JobStatus(str, enum.Enum):
    """OpenAI's video statuses; a str so it reads as its value in JSON and in the table."""

    QUEUED = "queued"  # waiting for a runner (new, or put back after a lost replica / a restart)
    IN_PROGRESS = "in_progress"  # claimed by a runner under a lease
    COMPLETED = "completed"  # the mp4 and its thumbnail are stored; expires_at is set
    FAILED = "failed"  # error says why; expires_at is set


class ListOrder(str, enum.Enum):
    """``GET /v1/videos?order=``: by creation time."""

    ASC = "asc"  # oldest first
    DESC = "desc"  # newest first (OpenAI's default)


@dataclass(frozen=True)
class JobParams:
    """What a job generates; fixed at creation (the seed too), so a rerun makes the same video."""

    prompt: str
    negative_prompt: str | None
    width: int
    height: int
    num_frames: int
    fps: int
    steps: int
    guidance_scale: float
    seed: int
    seconds: str  # as the client sees it in the video object ("1", "2.25")
    # Image-to-video: the checked reference image, base64 (the record is JSON); None for text only.
    reference_image: str | None = None
    # The LoRA adapter by its configured name and its resolved scale (GenerationSpec.lora); None: the
    # base model. Records written before adapters existed read as None.
    lora: str | None = None
    lora_scale: float = 1.0
    # A remix (POST /v1/videos/{id}/remix): whether the job edits a video kept beside its results
    # (ResultFolder.put_source, by this job's id: a rerun edits the same frames whatever became of the
    # source job; not in the record, which every poll and list reads); how far it may go from it (0-1];
    # the source job's id.
    source_video: bool = False
    strength: float | None = None
    remixed_from: str | None = None
    # An extension (POST /v1/videos/extensions): its source's frames (kept as above) go before the frames it
    # makes from the source's last frame (``reference_image``) without that first one; ``num_frames`` are the
    # frames it makes, ``seconds`` the whole video's.
    extends: bool = False
    source_frames: int = 0

    @property
    def video_frames(self) -> int:
        """The frames of the finished video: an extension's source's and its own but the first."""
        return self.num_frames + (self.source_frames - 1 if self.extends else 0)


@dataclass(frozen=True)
class JobError:
    """Why a job failed, as OpenAI's video ``error`` object."""

    code: str
    message: str


@dataclass(frozen=True)
class VideoJob:
    id: str
    model: str
    status: JobStatus
    progress: int  # 0..100
    created_at: int
    completed_at: int | None
    expires_at: int | None
    params: JobParams
    attempts: int  # claims so far
    owner: str | None  # the lease while in progress: "<runner>/<attempt>", so a stale attempt holds nothing
    error: JobError | None
    result_key: str | None  # where the runner stored the mp4 and thumbnail (per attempt)

    @property
    def size(self) -> str:
        return f"{self.params.width}x{self.params.height}"

    def to_json(self) -> dict:
        """OpenAI's video object (``openai.types.Video``)."""
        error = None if self.error is None else {"code": self.error.code, "message": self.error.message}
        return {"id": self.id, "object": "video", "model": self.model, "status": self.status.value,
                "progress": self.progress, "created_at": self.created_at, "completed_at": self.completed_at,
                "expires_at": self.expires_at, "prompt": self.params.prompt, "seconds": self.params.seconds,
                "size": self.size, "error": error, "remixed_from_video_id": self.params.remixed_from}


@dataclass(frozen=True)
class JobPage:
    jobs: tuple[VideoJob, ...]
    has_more: bool


_SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    id TEXT PRIMARY KEY,       -- video_<creation time in us, hex><random>: lists sort by it; claims by rowid
    model TEXT NOT NULL,
    status TEXT NOT NULL,
    progress INTEGER NOT NULL,
    created_at INTEGER NOT NULL,
    completed_at INTEGER,
    expires_at INTEGER,
    params TEXT NOT NULL,      -- JobParams as JSON
    attempts INTEGER NOT NULL,
    owner TEXT,
    lease_until REAL,
    not_before REAL NOT NULL,  -- a job put back after overload waits this long before a new claim
    error_code TEXT,
    error_message TEXT,
    result_key TEXT
);
CREATE INDEX IF NOT EXISTS jobs_by_status ON jobs (status, id);
"""


def _row_to_job(row: sqlite3.Row) -> VideoJob:
    error = JobError(row["error_code"], row["error_message"]) if row["error_code"] else None
    return VideoJob(row["id"], row["model"], JobStatus(row["status"]), row["progress"], row["created_at"],
                    row["completed_at"], row["expires_at"], JobParams(**json.loads(row["params"])),
                    row["attempts"], row["owner"], error, row["result_key"])


class SqliteJobQueue:
    """Every job of one application in one SQLite file; each method is one transaction."""

    def __init__(self, path: str | os.PathLike, expire_after_s: float, lease_s: float,
                 clock: Callable[[], float] = time.time):
        self.path = pathlib.Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.expire_after_s, self.lease_s, self.clock = expire_after_s, lease_s, clock
        # One connection, used under one lock: the actor runs one call at a time anyway, and an
        # in-process queue (tests, a single process) may be called from several threads.
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        self._db.row_factory = sqlite3.Row
        self._db.execute("PRAGMA journal_mode=WAL")  # a crash mid-write leaves the last commit intact
        self._db.executescript(_SCHEMA)
        self._lock = threading.Lock()
        self._requeue_interrupted()

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    def close(self) -> None:
        with self._lock:
            self._db.close()

    # -- lifecycle --------------------------------------------------------------------------------
    def _requeue_interrupted(self) -> None:
        """Opening the file: jobs that were running when the service stopped go back in the queue."""
        with self._transaction() as db:
            rows = db.execute("SELECT * FROM jobs WHERE status = ?", (JobStatus.IN_PROGRESS.value,)).fetchall()
        for row in rows:
            self._put_back(row["id"], row["owner"], "the service stopped while it ran", counted=True, delay_s=0)

    def create(self, job: VideoJob) -> VideoJob:
        with self._transaction() as db:
            db.execute("INSERT INTO jobs VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
                       (job.id, job.model, job.status.value, job.progress, job.created_at, None, None,
                        json.dumps(asdict(job.params)), 0, None, None, 0.0, None, None, None))
        logger.info("job %s queued: %s, %d frames at %d fps, %d steps, seed %d", job.id, job.size,
                    job.params.num_frames, job.params.fps, job.params.steps, job.params.seed)
        return job

    def get(self, job_id: str) -> VideoJob | None:
        with self._transaction() as db:
            row = db.execute("SELECT * FROM jobs WHERE id = ?", (job_id,)).fetchone()
        return None if row is None else _row_to_job(row)

    def list(self, after: str | None, limit: int, order: ListOrder) -> JobPage:
        """One page by creation time; ``after`` is the last id of the previous page (it may be gone)."""
        op, direction = (">", "ASC") if order is ListOrder.ASC else ("<", "DESC")
        where, args = (f"WHERE id {op} ?", (after,)) if after else ("", ())
        with self._transaction() as db:
            rows = db.execute(f"SELECT * FROM jobs {where} ORDER BY id {direction} LIMIT ?",
                              (*args, limit + 1)).fetchall()
        return JobPage(tuple(_row_to_job(r) for r in rows[:limit]), len(rows) > limit)

    # -- runners ----------------------------------------------------------------------------------
    def claim(self, owner: str, limit: int) -> tuple[VideoJob, ...]:
        """Up to ``limit`` queued jobs, oldest first, now in progress; each job's ``owner`` is its
        lease, ``<owner>/<attempt>``, which every later call about the job must name."""
        self._reclaim_lapsed()
        now = self.clock()
        with self._transaction() as db:
            # Oldest first by insertion (rowid), not by id: two jobs queued in one microsecond, or by
            # replicas whose clocks differ, have ids whose order is their random tails' or the clocks'.
            rows = db.execute("SELECT id FROM jobs WHERE status = ? AND not_before <= ? ORDER BY rowid LIMIT ?",
                              (JobStatus.QUEUED.value, now, limit)).fetchall()
            for row in rows:
                db.execute("UPDATE jobs SET status = ?, owner = ? || '/' || (attempts + 1), lease_until = ?, "
                           "attempts = attempts + 1, progress = 0 WHERE id = ?",
                           (JobStatus.IN_PROGRESS.value, owner, now + self.lease_s, row["id"]))
            claimed = [db.execute("SELECT * FROM jobs WHERE id = ?", (r["id"],)).fetchone() for r in rows]
        jobs = tuple(_row_to_job(r) for r in claimed)
        for job in jobs:
            logger.info("job %s claimed by %s (attempt %d of %d)", job.id, owner, job.attempts, MAX_ATTEMPTS)
        return jobs

    def due_in(self) -> float | None:
        """Seconds until :meth:`claim` could return a job (0: now; a queued job waits for its ``not_before``,
        a running one's lease lapses at ``lease_until``), by this queue's clock; None: no job is queued or running."""
        now = self.clock()
        with self._transaction() as db:
            queued = db.execute("SELECT MIN(not_before) FROM jobs WHERE status = ?", (JobStatus.QUEUED.value,)
                                ).fetchone()[0]
            leased = db.execute("SELECT MIN(lease_until) FROM jobs WHERE status = ?", (JobStatus.IN_PROGRESS.value,)
                                ).fetchone()[0]
        if queued is not None and queued <= now or leased is not None and leased < now:
            return 0.0
        times = [t for t in (queued, leased) if t is not None]
        # A lease is reclaimed once strictly past its end (_reclaim_lapsed): a hair after it.
        return None if not times else min(times) - now + (1e-3 if min(times) == leased else 0.0)

    def _reclaim_lapsed(self) -> None:
        """Jobs whose runner stopped renewing its lease (its replica died) go back in the queue."""
        with self._transaction() as db:
            rows = db.execute("SELECT id, owner FROM jobs WHERE status = ? AND lease_until < ?",
                              (JobStatus.IN_PROGRESS.value, self.clock())).fetchall()
        for row in rows:
            self._put_back(row["id"], row["owner"], f"its runner {row['owner']} stopped renewing its "
                                                    f"{self.lease_s:g} s lease", counted=True, delay_s=0)

    def renew(self, leases: tuple[tuple[str, str], ...], progress: dict[str, int] | None = None
              ) -> frozenset[str]:
        """Extend leases, given as (job id, lease), and record progress; returns the ids still held.

        An id missing from the answer was deleted (cancelled) or reclaimed: the runner stops it.
        """
        progress = progress or {}
        with self._transaction() as db:
            held = set()
            for job_id, lease in leases:
                cur = db.execute("UPDATE jobs SET lease_until = ?, progress = MAX(progress, ?) "
                                 "WHERE id = ? AND owner = ? AND status = ?",
                                 (self.clock() + self.lease_s, progress.get(job_id, 0), job_id, lease,
                                  JobStatus.IN_PROGRESS.value))
                if cur.rowcount:
                    held.add(job_id)
        return frozenset(held)

    def complete(self, job_id: str, owner: str, result_key: str) -> bool:
        """Mark done with its result; False if the lease ``owner`` is no longer held (the caller drops the result)."""
        now = self.clock()
        with self._transaction() as db:
            cur = db.execute("UPDATE jobs SET status = ?, progress = 100, completed_at = ?, expires_at = ?, "
                             "owner = NULL, lease_until = NULL, result_key = ? WHERE id = ? AND owner = ? "
                             "AND status = ?", (JobStatus.COMPLETED.value, int(now), int(now + self.expire_after_s),
                                                result_key, job_id, owner, JobStatus.IN_PROGRESS.value))
        if cur.rowcount:
            logger.info("job %s completed by %s; result %s kept until +%g s", job_id, owner, result_key,
                        self.expire_after_s)
        return bool(cur.rowcount)

    def fail(self, job_id: str, owner: str, error: JobError) -> bool:
        now = self.clock()
        with self._transaction() as db:
            cur = db.execute("UPDATE jobs SET status = ?, completed_at = ?, expires_at = ?, owner = NULL, "
                             "lease_until = NULL, error_code = ?, error_message = ? WHERE id = ? AND owner IS ? "
                             "AND status = ?", (JobStatus.FAILED.value, int(now), int(now + self.expire_after_s),
                                                error.code, error.message, job_id, owner,
                                                JobStatus.IN_PROGRESS.value))
        if cur.rowcount:
            logger.info("job %s failed: %s (%s)", job_id, error.message, error.code)
        return bool(cur.rowcount)

    def put_back(self, job_id: str, owner: str, reason: str, counted: bool, delay_s: float) -> VideoJob | None:
        """Give a job up: back in the queue, or failed if it was counted and had its retry already.

        ``counted=False`` (overload: the stage queue was full, the device busy) does not use up the
        retry; it waits ``delay_s`` before another claim.
        """
        return self._put_back(job_id, owner, reason, counted, delay_s)

    def _put_back(self, job_id: str, owner: str | None, reason: str, counted: bool, delay_s: float
                  ) -> VideoJob | None:
        with self._transaction() as db:
            row = db.execute("SELECT * FROM jobs WHERE id = ? AND owner IS ? AND status = ?",
                             (job_id, owner, JobStatus.IN_PROGRESS.value)).fetchone()
            if row is None:
                return None
            if counted and row["attempts"] >= MAX_ATTEMPTS:
                give_up = True
            else:
                give_up = False
                db.execute("UPDATE jobs SET status = ?, owner = NULL, lease_until = NULL, progress = 0, "
                           "attempts = attempts - ?, not_before = ? WHERE id = ?",
                           (JobStatus.QUEUED.value, 0 if counted else 1, self.clock() + delay_s, job_id))
        if give_up:
            self.fail(job_id, owner, JobError("retries_exhausted", f"attempt {row['attempts']} of {MAX_ATTEMPTS} "
                                                                   f"was lost too: {reason}"))
        else:
            logger.info("job %s back in the queue after attempt %d (%s; %s, claimable in %g s)", job_id,
                        row["attempts"], reason, "its one retry" if counted else "not counted", delay_s)
        return self.get(job_id)

    # -- clients ----------------------------------------------------------------------------------
    def delete(self, job_id: str) -> VideoJob | None:
        """Remove a job in any state; its runner (if any) finds out at its next renewal and stops."""
        with self._transaction() as db:
            row = db.execute("SELECT * FROM jobs WHERE id = ?", (job_id,)).fetchone()
            db.execute("DELETE FROM jobs WHERE id = ?", (job_id,))
        if row is None:
            return None
        job = _row_to_job(row)
        logger.info("job %s deleted while %s%s", job_id, job.status.value,
                    f" (cancelling its run on {job.owner})" if job.owner else "")
        return job

    def expire(self) -> tuple[VideoJob, ...]:
        """Remove every finished job past its ``expires_at``; the caller deletes their results."""
        now = self.clock()
        with self._transaction() as db:
            rows = db.execute("SELECT * FROM jobs WHERE expires_at IS NOT NULL AND expires_at <= ?",
                              (now,)).fetchall()
            db.execute("DELETE FROM jobs WHERE expires_at IS NOT NULL AND expires_at <= ?", (now,))
        jobs = tuple(_row_to_job(r) for r in rows)
        for job in jobs:
            logger.info("job %s expired (%s at %d, expiry %d <= now %d)", job.id, job.status.value,
                        job.completed_at, job.expires_at, now)
        return jobs


def new_job(job_id: str, model: str, params: JobParams, created_at: int) -> VideoJob:
    return VideoJob(job_id, model, JobStatus.QUEUED, 0, created_at, None, None, params, 0, None, None, None)


def new_job_id(now: float) -> str:
    """``video_`` + creation time in microseconds (14 hex digits, so ids sort by time) + 40 random bits."""
    return f"video_{int(now * 1_000_000):014x}{secrets.token_hex(5)}"
