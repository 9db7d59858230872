"""The host copier: the thread that fills pinned staging buffers while the launch thread runs kernels.

On CUDA a copy from pageable or file-mapped memory blocks the calling thread until it lands, so
the engine never issues one from the thread that launches kernels: a host thread copies each such
layer into a pinned staging buffer first (``offload_core.streaming.staging``), and the launch
thread only issues the asynchronous copy from pinned memory. On CPU every copy is synchronous
anyway, so the copier runs each job at once, in the caller's thread (:class:`InlineCopier`).

Also the engine's typed copy errors: :class:`CopyFailed` (a layer's copy to the device raised) and
:class:`FillTimeout` (a staging fill did not finish within its bounded wait). The service answers
both with 503 (the replica stays usable: every slot and buffer was given back).
"""
from __future__ import annotations

import concurrent.futures
import threading
import time
from typing import Callable, Protocol


class CopyFailed(RuntimeError):
    """A layer's copy to the device failed; the request fails, the engine's slots and buffers are whole."""


class FillTimeout(CopyFailed):
    """A staging fill did not finish within ``StreamingConfig.fill_timeout_s`` (a hung file mapping)."""


class CopyJob(Protocol):
    """What a submitted job hands back (a ``concurrent.futures.Future`` is one)."""

    def result(self, timeout: float | None = None) -> object:
        """Wait (at most ``timeout`` s, then ``TimeoutError``) for the job; re-raises its error."""

    def done(self) -> bool: ...

    def cancel(self) -> bool:
        """Drop the job if it has not started; True when it will never run."""


class HostCopier(Protocol):
    @property
    def cpu_s(self) -> float:
        """CPU seconds the copier's jobs used so far (their thread's CPU time)."""

    def submit(self, job: Callable[[], None]) -> CopyJob: ...

    def close(self, wait: bool = True) -> None: ...


class InlineCopier:
    """Runs each job at once in the caller's thread (CPU: copies are synchronous anyway)."""

    def __init__(self) -> None:
        self.cpu_s = 0.0

    def submit(self, job: Callable[[], None]) -> CopyJob:
        done: concurrent.futures.Future = concurrent.futures.Future()
        start = time.thread_time()
        try:
            done.set_result(job())
        except BaseException as error:  # handed to result(), as a thread's future would
            done.set_exception(error)
        self.cpu_s += time.thread_time() - start
        return done

    def close(self, wait: bool = True) -> None:
        """Nothing runs in the background."""


class ThreadCopier:
    """One host thread, jobs in submission order (a staging buffer is filled before the next one)."""

    def __init__(self, name: str):
        # One worker: host memcpy bandwidth is shared, two threads would only interleave the same
        # bytes; and in-order fills keep the staging ring a plain FIFO.
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        self._cpu_s = 0.0
        self._lock = threading.Lock()

    @property
    def cpu_s(self) -> float:
        with self._lock:
            return self._cpu_s

    def submit(self, job: Callable[[], None]) -> CopyJob:
        return self._pool.submit(self._timed, job)

    def _timed(self, job: Callable[[], None]) -> None:
        # The copier thread's own CPU time (time.thread_time): a memcpy counts, a blocking event
        # wait does not; a spinning wait would (what bench/streaming.py's copier figure shows).
        start = time.thread_time()
        try:
            job()
        finally:
            with self._lock:
                self._cpu_s += time.thread_time() - start

    def close(self, wait: bool = True) -> None:
        """Join the thread; ``wait=False`` leaves a hung job behind (its thread ends when it does)."""
        self._pool.shutdown(wait=wait, cancel_futures=not wait)
