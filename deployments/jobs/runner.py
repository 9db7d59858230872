"""The job runner in every ingress replica: claims queued jobs, runs them, stores the results.

Each replica claims up to ``max_running_per_ingress`` jobs from the application's one queue and
drives them through the same stage handles as the synchronous routes. While a job runs, every
denoising step renews its lease and records its progress; the answer says whether the job is still
this runner's, so a ``DELETE`` through any replica stops the run within one step (the task is
cancelled, which cancels the Denoiser's call at its next step boundary).

Failures: overload (a full stage queue, a busy device) puts the job back without using its retry;
a lost stage replica puts it back once (its retry), after a delay so the retry reaches the
replacement; anything else fails the job with the reason. A runner that dies stops renewing, and
the queue queues its jobs again when their leases lapse: no job stays in progress forever.
"""
from __future__ import annotations

import asyncio
import base64
import logging
import time
from typing import Awaitable, Callable

import numpy as np

from deployments.jobs.queue import JobQueue, JobsArgs
from deployments.jobs.records import JobError, JobParams, VideoJob
from deployments.jobs.results import ResultFolder, Variant, result_key
from deployments.wire import media
from deployments.wire.failures import FailureKind, FailureSorter
from deployments.wire.spec import DenoiseProgress, EditRule, GenerationSpec

logger = logging.getLogger(__name__)

OnProgress = Callable[[DenoiseProgress], Awaitable[None]]
# The stage pipeline for one video: its frames (frames, H, W, 3), float32 in [0, 1].
Generate = Callable[[GenerationSpec, OnProgress], Awaitable[object]]

# A failed queue call (the actor restarting) is retried after this (or the poll interval if shorter):
# the old default poll, so a restarted queue is found as soon as before.
RETRY_S = 0.5
# The queue is swept for expired jobs every this many looks (at most every 100 s at the default 5 s poll;
# jobs expire after a day).
SWEEP_EVERY_POLLS = 20


def params_spec(params: JobParams, request_id: str, source: bytes | None = None) -> GenerationSpec:
    """The generation a job with ``params`` runs (one video); ``source``: a video edit's source mp4 (None where
    only the shape matters, as admission, and for an extension, whose source goes before its frames)."""
    p = params
    reference = None if p.reference_image is None else base64.b64decode(p.reference_image)
    # A video edit is its family's video-to-video pipeline's (the only one there is: Wan's); the rule is read
    # only where ``strength`` is set.
    return GenerationSpec(request_id, p.prompt, p.negative_prompt, p.height, p.width, p.num_frames, p.steps,
                          p.guidance_scale, p.seed, 1, reference, lora=p.lora, lora_scale=p.lora_scale,
                          strength=p.strength, edit_rule=EditRule.VIDEO2VIDEO, reference_video=source)


class SourceVideoGone(RuntimeError):
    """An edit's or an extension's source video is no longer where its creation put it (the results location
    lost it)."""


def progress_percent(step: int, total: int) -> int:
    """Step k of n is k/(n+1) of the job: the last share is decoding and encoding; 100 means stored."""
    return min(99, 100 * step // (total + 1))


def encode_video(frames, fps: int) -> dict[Variant, bytes]:
    """The mp4, a PNG thumbnail of the first frame and a JPEG spritesheet."""
    return {Variant.VIDEO: media.mp4_bytes(frames, fps), Variant.THUMBNAIL: media.png_bytes(frames[0]),
            Variant.SPRITESHEET: media.spritesheet_bytes(frames)}


class JobRunner:
    def __init__(self, queue: JobQueue, results: ResultFolder, generate: Generate, owner: str, args: JobsArgs,
                 retry_after_s: float, failures: FailureSorter):
        """``failures`` sorts a failed generation (overload: put back; lost replica: one retry; else fail)."""
        self.queue, self.results, self.generate = queue, results, generate
        self.failures = failures
        self.owner, self.args, self.retry_after_s = owner, args, retry_after_s
        self._running: dict[str, asyncio.Task] = {}
        self._leases: dict[str, str] = {}  # job id -> the lease its claim returned ("<owner>/<attempt>")
        self._progress: dict[str, int] = {}
        self._loop_task: asyncio.Task | None = None
        self._stopping = False
        self._wake: asyncio.Event | None = None
        self._waiting: asyncio.Future | None = None  # the queue's answer to this runner's wait for work
        self._wait_failed = False

    # -- control ----------------------------------------------------------------------------------
    def start(self) -> bool:
        """Start the claim loop on the running event loop; False if there is none yet (call again)."""
        if self._loop_task is not None:
            return True
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return False
        self._wake = asyncio.Event()
        self._loop_task = loop.create_task(self._claim_loop(), name=f"video-jobs-{self.owner}")
        logger.info("job runner %s started: up to %d jobs at once, lease %g s", self.owner,
                    self.args.max_running_per_ingress, self.args.lease_s)
        return True

    def wake(self) -> None:
        """A job was just queued through this replica: look now rather than at the next poll."""
        if self._wake is not None:
            self._wake.set()

    def cancel(self, job_id: str) -> bool:
        task = self._running.get(job_id)
        if task is None:
            return False
        task.cancel()
        return True

    async def stop(self) -> None:
        """Stop claiming and cancel what runs (the queue queues those jobs again when their leases lapse)."""
        self._stopping = True
        tasks = [t for t in (self._loop_task, *self._running.values()) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    @property
    def running(self) -> frozenset[str]:
        return frozenset(self._running)

    # -- the loop ---------------------------------------------------------------------------------
    async def _claim_loop(self) -> None:
        renew_every = self.args.lease_s / 3
        last_renew, polls = time.monotonic(), 0
        try:
            while not self._stopping:
                failed = False
                try:
                    if time.monotonic() - last_renew >= renew_every:
                        await self._renew_all()
                        last_renew = time.monotonic()
                    if polls % SWEEP_EVERY_POLLS == 0:
                        await self.queue.expire()
                    free = self.args.max_running_per_ingress - len(self._running)
                    if free > 0:
                        for job in await self.queue.claim(self.owner, free):
                            self._start(job)
                except asyncio.CancelledError:
                    raise
                except Exception as exc:  # the queue is restarting or unreachable: keep polling
                    failed = True
                    logger.warning("job runner %s: queue call failed (%s: %s); retrying in %g s", self.owner,
                                   type(exc).__name__, exc, min(self.args.poll_interval_s, RETRY_S))
                polls += 1
                timeout = min(self.args.poll_interval_s, RETRY_S) if failed else self.args.poll_interval_s
                if self._running:  # the leases are renewed on time however long the wait
                    timeout = min(timeout, max(0.0, last_renew + renew_every - time.monotonic()))
                await self._wait(timeout, ask_queue=not failed)
        finally:
            if self._waiting is not None:
                self._waiting.cancel()

    async def _wait(self, timeout: float, ask_queue: bool) -> None:
        """Until ``timeout``, a local :meth:`wake`, or (with a free slot) the queue's word that a job can be
        claimed: it answers as soon as one is queued through any replica or falls due, so an idle runner
        makes one call per poll interval (a look at 0.2 s cost it and the queue 0.85 CPU-s per 30 s)."""
        self._wake.clear()
        # asyncio.wait, not wait_for: Python 3.11's wait_for can swallow a cancellation that
        # lands as its timeout fires, and stop() would then wait for this loop forever.
        waiters = {asyncio.ensure_future(self._wake.wait())}
        ask_queue = ask_queue and not self._wait_failed
        if ask_queue and len(self._running) < self.args.max_running_per_ingress:
            if self._waiting is None or self._waiting.done():  # one wait in flight per runner, kept across turns
                self._waiting = asyncio.ensure_future(self.queue.wait_for_work(self.args.poll_interval_s))
            waiters.add(self._waiting)
            if not self._running:  # the queue's answer ends the turn (a timeout racing it made 2 turns of 1)
                timeout = 2 * self.args.poll_interval_s
        try:
            await asyncio.wait(waiters, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for waiter in waiters - {self._waiting}:
                waiter.cancel()
        waiting, self._wait_failed = self._waiting, False
        if waiting is not None and waiting.done() and not waiting.cancelled() and waiting.exception() is not None:
            # Claim next, then a whole poll interval without a wait (no spin on a queue that fails it: a
            # queue actor started by an older release, detached, has no wait_for_work).
            self._waiting, self._wait_failed = None, True
            logger.warning("job runner %s: wait for work failed (%s: %s); looking every %g s", self.owner,
                           type(waiting.exception()).__name__, waiting.exception(), self.args.poll_interval_s)

    def _start(self, job: VideoJob) -> None:
        stale = self._running.get(job.id)
        if stale is not None:  # an earlier attempt here whose lease lapsed (a stalled loop): it lost the job
            stale.cancel()
            logger.info("job %s: attempt %d replaces this runner's stalled earlier attempt", job.id, job.attempts)
        self._leases[job.id] = job.owner
        self._running[job.id] = asyncio.create_task(self._run(job), name=job.id)

    async def _renew_all(self) -> None:
        leases = tuple(self._leases.items())
        if leases:
            held = await self.queue.renew(leases, {i: self._progress.get(i, 0) for i, _ in leases})
            self._stop_unheld(tuple(i for i, _ in leases), held)

    def _stop_unheld(self, ids: tuple[str, ...], held: frozenset[str]) -> None:
        for job_id in set(ids) - held:
            if self.cancel(job_id):
                logger.info("job %s is no longer %s's (deleted or reclaimed): its run is cancelled", job_id,
                            self.owner)

    # -- one job ----------------------------------------------------------------------------------
    async def _run(self, job: VideoJob) -> None:
        key, lease = result_key(job.id, job.attempts), job.owner
        started = time.monotonic()

        async def on_progress(step: DenoiseProgress) -> None:
            self._progress[job.id] = progress_percent(step.step, step.total)
            if job.id not in await self.queue.renew(((job.id, lease),), {job.id: self._progress[job.id]}):
                logger.info("job %s is no longer %s's (deleted or reclaimed): its run is cancelled", job.id, lease)
                raise asyncio.CancelledError

        try:
            frames = await self.generate(await self._spec(job), on_progress)
            prefix = await self._extended(job)
            if prefix is not None:  # an extension's first frame is the source's last: it stands once
                frames = np.concatenate([prefix, media.to_uint8(frames[1:])])
            assets = await asyncio.to_thread(encode_video, frames, job.params.fps)
            for variant, data in assets.items():
                await asyncio.to_thread(self.results.put, key, variant, data)
            if await self.queue.complete(job.id, lease, key):
                logger.info("job %s done in %.2f s: %d B mp4 stored as %s", job.id, time.monotonic() - started,
                            len(assets[Variant.VIDEO]), key)
            else:  # deleted while it ran: nobody will ask for this result
                await asyncio.to_thread(self.results.delete, key)
        except asyncio.CancelledError:
            await asyncio.to_thread(self.results.delete, key)
            logger.info("job %s: run cancelled after %.2f s", job.id, time.monotonic() - started)
        except Exception as exc:
            await self._failed(job, lease, exc)
        finally:
            if self._running.get(job.id) is asyncio.current_task():  # not a later attempt's entry
                del self._running[job.id]
                self._leases.pop(job.id, None)
                self._progress.pop(job.id, None)
            self.wake()

    async def _spec(self, job: VideoJob) -> GenerationSpec:
        """The job's generation: a remix's with its source video, read from the results location."""
        if not job.params.source_video or job.params.extends:
            return params_spec(job.params, job.id)
        return params_spec(job.params, job.id, await self._source(job))

    async def _extended(self, job: VideoJob) -> np.ndarray | None:
        """An extension's source frames at the job's size, 8-bit (the whole video is held so: 162 frames of
        832x480 are 194 MB); None for any other job."""
        p = job.params
        if not p.extends:
            return None
        return await asyncio.to_thread(media.video_frames, await self._source(job), p.source_frames,
                                       (p.width, p.height))

    async def _source(self, job: VideoJob) -> bytes:
        source = await asyncio.to_thread(self.results.get_source, job.id)
        if source is None:
            raise SourceVideoGone(f"the source video of {job.id} is gone from {self.results.url}")
        return source

    async def _failed(self, job: VideoJob, lease: str, exc: Exception) -> None:
        kind = self.failures(exc).kind
        reason = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
        try:
            if kind.overload:
                await self.queue.put_back(job.id, lease, f"overload ({reason})", False, self.retry_after_s)
            elif kind is FailureKind.LOST_REPLICA:
                await self.queue.put_back(job.id, lease, f"a stage replica was lost ({reason})", True,
                                          self.args.replica_retry_delay_s)
            else:
                logger.error("job %s failed", job.id, exc_info=exc)
                await self.queue.fail(job.id, lease, JobError("generation_failed", reason))
        except Exception as queue_exc:  # the lease lapses and the queue puts the job back
            logger.warning("job %s: could not record its failure (%s); its lease will lapse", job.id, queue_exc)
