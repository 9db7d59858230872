"""One long-lived thread per stage replica for its model calls (the encoder's and the decoder's).

Runs in each TextEncoder and VaeDecoder replica (the Denoiser has its own: the step batcher's).
Serve runs a deployment's sync methods on AnyIO's worker thread, where a call's freed memory goes
back to the kernel and is page-faulted in again on every call (see docs/benchmarks.md, "What the
service adds over Ray Serve's floor"); on a thread of the replica's own it stays. So the async
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
