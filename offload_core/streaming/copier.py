"""The host copier: the thread that fills pinned staging buffers while the launch thread runs kernels.

On CUDA a copy from pageable or file-mapped memory blocks the calling thread until it lands, so
the engine never issues one from the thread that launches kernels: a host thread copies each such
layer into a pinned staging buffer first (``offload_core.streaming.staging``), and the launch
thread only issues the asynchronous copy from pinned memory. On CPU every copy is synchronous
anyway, so the copier runs each job at once, in the caller's thread (:class:`InlineCopier`).

A fill splits its bytes over the copier's ``threads`` (:class:`FillSplitter`): the copier thread
copies one share and ``threads - 1`` helper threads the others (``copy_`` releases the GIL). One
thread's memcpy runs at what torch's intra-op threads give it, and a replica actor Ray starts with
no CPUs asked runs with ``OMP_NUM_THREADS=1``: on an H200 host one thread copied pageable memory
into pinned at 5.0 GB/s, two split copies at 10.1, four at 18.5, against a 55 GB/s link. The
helpers are the copier's own; the process-wide thread count compute uses stays as it is.

Also the engine's typed copy errors: :class:`CopyFailed` (a layer's copy to the device raised) and
:class:`FillTimeout` (a staging fill did not finish within its bounded wait). The service answers
both with 503 (the replica stays usable: every slot and buffer was given back).
"""
from __future__ import annotations

import concurrent.futures
import threading
import time
from typing import Callable, Protocol, Sequence

import torch


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


CopyPair = tuple[torch.Tensor, torch.Tensor]  # (dst, src): 1-D, one dtype, one length
# A share of a split fill is at least this many bytes: handing a share to a helper costs tens of
# microseconds, a 4 MiB memcpy at one thread's 5 GB/s 0.8 ms. Read at each fill (tests lower it).
MIN_SHARE_BYTES = 4 * 1024 * 1024
# Cuts inside a tensor fall on this many bytes from its start: whole cache lines per thread (no
# line written by two), and a multiple of every element size.
SPLIT_ALIGN = 64


def split_pairs(pairs: Sequence[CopyPair], shares: int, align: int = SPLIT_ALIGN) -> list[list[CopyPair]]:
    """``pairs`` cut into at most ``shares`` lists of about equal bytes; every byte in exactly one.

    Whole pairs stay whole where they fit a share; a pair crossing a share's end is sliced at an
    ``align``-byte boundary from its start. Each (dst, src) must be 1-D, of one dtype and length.
    """
    if shares < 1:
        raise ValueError(f"shares must be >= 1, got {shares}")
    for dst, src in pairs:
        if dst.dim() != 1 or src.shape != dst.shape or src.dtype != dst.dtype:
            raise ValueError(f"a split copy needs 1-D (dst, src) of one dtype and length, got {tuple(dst.shape)} "
                             f"{dst.dtype} <- {tuple(src.shape)} {src.dtype}")
    total = sum(dst.numel() * dst.element_size() for dst, _ in pairs)
    target = -(-total // shares)
    out: list[list[CopyPair]] = [[]]
    filled = 0
    for dst, src in pairs:
        item, nbytes, at = dst.element_size(), dst.numel() * dst.element_size(), 0
        while at < nbytes:
            if len(out) < shares and filled >= target:
                out.append([])
                filled = 0
            last = len(out) == shares
            take = nbytes - at if last else min(nbytes - at, target - filled)
            if take < nbytes - at:
                take -= take % max(align, item)
                if take == 0:  # the share's room is under one aligned cut: the next share starts here
                    out.append([])
                    filled = 0
                    continue
            lo, hi = at // item, (at + take) // item
            out[-1].append((dst[lo:hi], src[lo:hi]))
            at, filled = at + take, filled + take
    return [share for share in out if share]


def copy_pairs(pairs: Sequence[CopyPair]) -> int:
    """Each (dst, src) copied in order in the calling thread; the bytes copied."""
    copied = 0
    for dst, src in pairs:
        dst.copy_(src, non_blocking=True)
        copied += dst.numel() * dst.element_size()
    return copied


class FillSplitter:
    """One fill's copies over ``threads`` host threads: the caller's and ``threads - 1`` helpers."""

    def __init__(self, threads: int, name: str):
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
            raise ValueError(f"copier threads must be an int >= 1, got {threads!r}")
        self.threads = threads
        self._helpers = (concurrent.futures.ThreadPoolExecutor(max_workers=threads - 1,
                                                               thread_name_prefix=f"{name}-split")
                         if threads > 1 else None)
        self._lock = threading.Lock()
        self.helper_cpu_s = 0.0  # the helpers' CPU time (the caller's is its own thread's)

    def copy(self, pairs: Sequence[CopyPair]) -> int:
        """Copy every (dst, src), split over the threads when the bytes give each a share worth it.

        Every share is waited for, also when one raised (no helper writes past the return); the
        first error is raised then. The bytes land as one ``copy_`` each would put them.
        """
        total = sum(dst.numel() * dst.element_size() for dst, _ in pairs)
        shares = min(self.threads, max(1, total // max(1, MIN_SHARE_BYTES)))
        if shares == 1 or self._helpers is None:
            return copy_pairs(pairs)
        parts = split_pairs(pairs, shares)
        helpers = [self._helpers.submit(self._timed, part) for part in parts[1:]]
        try:
            copied = copy_pairs(parts[0])
        finally:
            concurrent.futures.wait(helpers)
        return copied + sum(future.result() for future in helpers)

    def _timed(self, pairs: Sequence[CopyPair]) -> int:
        start = time.thread_time()
        try:
            return copy_pairs(pairs)
        finally:
            with self._lock:
                self.helper_cpu_s += time.thread_time() - start

    def close(self, wait: bool = True) -> None:
        if self._helpers is not None:
            self._helpers.shutdown(wait=wait, cancel_futures=not wait)


class HostCopier(Protocol):
    threads: int  # each fill's copies split over this many threads

    @property
    def cpu_s(self) -> float:
        """CPU seconds the copier's jobs used so far (their threads' CPU time)."""

    def submit(self, job: Callable[[], None]) -> CopyJob: ...

    def copy(self, pairs: Sequence[CopyPair]) -> int:
        """Inside a job: copy each (dst, src), split over the copier's threads; the bytes copied."""

    def close(self, wait: bool = True) -> None: ...


class InlineCopier:
    """Runs each job at once in the caller's thread (CPU: copies are synchronous anyway).

    ``threads`` > 1 splits each fill's copies as on CUDA (tests; a CPU device computes on the
    same cores, so the engine gives it one)."""

    def __init__(self, threads: int = 1) -> None:
        self._split = FillSplitter(threads, "offload-inline")
        self.threads = threads
        self._own_cpu_s = 0.0

    @property
    def cpu_s(self) -> float:
        return self._own_cpu_s + self._split.helper_cpu_s

    def copy(self, pairs: Sequence[CopyPair]) -> int:
        return self._split.copy(pairs)

    def submit(self, job: Callable[[], None]) -> CopyJob:
        done: concurrent.futures.Future = concurrent.futures.Future()
        start = time.thread_time()
        try:
            done.set_result(job())
        except BaseException as error:  # handed to result(), as a thread's future would
            done.set_exception(error)
        self._own_cpu_s += time.thread_time() - start
        return done

    def close(self, wait: bool = True) -> None:
        """Only split helpers run in the background, and only while a fill waits for them."""
        self._split.close(wait)


class ThreadCopier:
    """One host thread, jobs in submission order (a staging buffer is filled before the next one);
    each fill's copies split over ``threads`` (that thread and ``threads - 1`` helpers)."""

    def __init__(self, name: str, threads: int = 1):
        # One job at a time: in-order fills keep the staging ring a plain FIFO; the parallelism is
        # inside a fill (FillSplitter), where one thread's memcpy falls short of the link.
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        self._split = FillSplitter(threads, name)
        self.threads = threads
        self._cpu_s = 0.0
        self._lock = threading.Lock()

    @property
    def cpu_s(self) -> float:
        with self._lock:
            return self._cpu_s + self._split.helper_cpu_s

    def copy(self, pairs: Sequence[CopyPair]) -> int:
        return self._split.copy(pairs)

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
        self._split.close(wait)
