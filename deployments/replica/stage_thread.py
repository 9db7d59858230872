"""One long-lived thread per stage replica for its model calls (the encoder's and the decoder's).

Runs in each TextEncoder and VaeDecoder replica (the Denoiser has its own: the step batcher's).
Serve runs a deployment's sync methods on AnyIO's worker thread, and there the tiny Wan's encoder
call (32x32) took 10,400-24,900 minor page faults and 4-53 ms of system time every time, in 30 calls
of one replica (2026-12-01, load 6-14): the memory it freed went back to the kernel between calls
and was faulted in again, most likely because that thread's malloc arena is shared with the
replica's other threads (glibc's, not measured apart). On a thread of this replica's own the same
calls took 0 faults in 25 of 30, and the replica's median call fell from 82.5 to 50.9 ms (64-71 ms
for the same code in process, which faults 4,000-10,700 times on its main thread). So the async
method hands the call to this thread; with ``max_ongoing_requests=1`` calls never overlap anyway.
The caller's context variables (Serve's request context: the request id in the replica's log
lines) go with the call; a call cancelled before it started never runs.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import functools
from typing import Callable, TypeVar

T = TypeVar("T")


class StageThread:
    """``await call(fn, *args)`` runs ``fn(*args)`` on this object's one thread, calls in arrival order."""

    def __init__(self, stage: str):
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"stage-{stage}")

    async def call(self, fn: Callable[..., T], *args) -> T:
        context = contextvars.copy_context()
        return await asyncio.get_running_loop().run_in_executor(
            self._executor, functools.partial(context.run, fn, *args))

    def close(self) -> None:
        """Replica shutdown: calls not started are dropped; the running one finishes on its own."""
        self._executor.shutdown(wait=False, cancel_futures=True)
