"""The host copier: the thread that fills pinned staging buffers while the launch thread runs kernels.

On CUDA a copy from pageable or file-mapped memory blocks the calling thread until it lands, so
the engine never issues one from the thread that launches kernels: a host thread copies each such
layer into a pinned staging buffer first (``offload_core.streaming.staging``), and the launch
thread only issues the asynchronous copy from pinned memory. On CPU every copy is synchronous
anyway, so the copier runs each job at once, in the caller's thread (:class:`InlineCopier`).
"""
from __future__ import annotations

import concurrent.futures
from typing import Callable, Protocol


class CopyJob(Protocol):
    """What a submitted job hands back: ``result()`` waits for it (and re-raises its error)."""

    def result(self) -> object: ...


class HostCopier(Protocol):
    def submit(self, job: Callable[[], None]) -> CopyJob: ...

    def close(self) -> None: ...


class InlineCopier:
    """Runs each job at once in the caller's thread (CPU: copies are synchronous anyway)."""

    def submit(self, job: Callable[[], None]) -> CopyJob:
        done: concurrent.futures.Future = concurrent.futures.Future()
        try:
            done.set_result(job())
        except BaseException as error:  # handed to result(), as a thread's future would
            done.set_exception(error)
        return done

    def close(self) -> None:
        """Nothing runs in the background."""


class ThreadCopier:
    """One host thread, jobs in submission order (a staging buffer is filled before the next one)."""

    def __init__(self, name: str):
        # One worker: host memcpy bandwidth is shared, two threads would only interleave the same
        # bytes; and in-order fills keep the staging ring a plain FIFO.
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)

    def submit(self, job: Callable[[], None]) -> CopyJob:
        return self._pool.submit(job)

    def close(self) -> None:
        self._pool.shutdown(wait=True)
