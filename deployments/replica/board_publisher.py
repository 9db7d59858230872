"""At most one send per interval, off the caller's thread, always with the latest state.

A stage replica publishes what changes on every call (its residency report, the Denoiser's batch
size) to the application's board. Sending on every change put an actor call (0.5-1 ms of CPU on
2 cores) on the request's path twice per request for the batch size alone, and a residency
report takes 2.5-6.6 ms of CPU to build; :class:`Throttled` sends after the change instead, in
its own thread, at most once per interval, and the state read at send time is the newest.
"""
from __future__ import annotations

import concurrent.futures
import threading
import time
from typing import Callable


class Throttled:
    """``poke()`` after a change: ``send()`` runs within ``interval_s`` (+ ``settle_s``) in this object's
    thread, at most once per ``interval_s``; pokes while a send is pending fold into it."""

    def __init__(self, send: Callable[[], None], interval_s: float, name: str, sent_now: bool = False,
                 keepalive_s: float | None = None, settle_s: float = 0.0):
        """``keepalive_s``: also send when nothing changed for that long (a receiver that restarted
        empty gets the state back without waiting for a change). ``settle_s``: a send waits at least
        this long after the poke that scheduled it (a stage call pokes just before its answer leaves
        the process: the send would take the GIL and the CPU from that answer)."""
        self._send, self._interval_s, self._settle_s = send, interval_s, settle_s
        self._executor = concurrent.futures.ThreadPoolExecutor(1, name)
        self._pending = threading.Event()
        # sent_now: the caller has just sent the current state itself (the next send waits a whole interval).
        self._sent_at = time.monotonic() - (0.0 if sent_now else interval_s)
        self._closed = threading.Event()
        self._keepalive = None
        if keepalive_s is not None:
            self._keepalive = threading.Thread(target=self._keep_alive, args=(keepalive_s,), name=f"{name}-keepalive",
                                               daemon=True)
            self._keepalive.start()

    def _keep_alive(self, keepalive_s: float) -> None:
        while not self._closed.wait(keepalive_s / 4):
            if time.monotonic() - self._sent_at >= keepalive_s:
                self.poke()

    def poke(self) -> None:
        """Schedule a send (never blocks: the caller may be a request's thread)."""
        if self._pending.is_set():
            return
        self._pending.set()
        delay_s = max(self._settle_s, self._sent_at + self._interval_s - time.monotonic())
        self._executor.submit(self._later, delay_s)

    def _later(self, delay_s: float) -> None:
        time.sleep(delay_s)
        self._pending.clear()  # a change from here on schedules the next send
        try:
            self._send()
        finally:
            self._sent_at = time.monotonic()

    def close(self) -> None:
        """Stop the keep-alive, wait for a pending send, then stop the thread."""
        self._closed.set()
        if self._keepalive is not None:
            self._keepalive.join()
        self._executor.shutdown(wait=True)
