"""A replica's device leases: a standing lease for what it keeps, a call reservation for what a call adds.

    leases = memory.device_leases(to_driver=torch.cuda.empty_cache)
    leases.hold_standing(kept_bytes, timeout_s)      # at start-up, before anything is allocated
    with leases.call(added_bytes, timeout_s):        # around every stage call
        run the stage
    leases.hold_standing(kept_bytes_now, timeout_s)  # when residency changed (round trip only then)

The standing lease covers what stays on the device between calls (resident components, kept
non-layer weights). A call leases only what it adds (streamed slots, staging, activations), and
keeps that lease between calls as a recallable reservation: a call whose bytes fit it makes no
ledger round trip (a grant is 7-9 ms at p50 on a loaded node, six per request before this). The
ledger recalls the reservation when a neighbour waits for the bytes; it also goes back after
``idle_s`` without calls. Bytes given back are first returned to the driver (``to_driver``:
``torch.cuda.empty_cache`` on CUDA), and never while a call of this process runs: the caching
allocator keeps freed blocks reserved, and a lease given back over them would let a neighbour
count on bytes this process still holds.

A call that needs more than its reservation gives the reservation back first and then waits for
the larger one: holding bytes while waiting for more could deadlock two replicas until timeout.
"""
from __future__ import annotations

import contextlib
import enum
import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable, Protocol

from offload_core.host.budget import Lease, Refusal
from offload_core.streaming.headroom import Headroom

logger = logging.getLogger(__name__)

# A reservation unused this long goes back: long enough to span the gaps of steady traffic
# (requests every few seconds), short enough that an idle replica's bytes return within a poll.
DEFAULT_IDLE_S = 10.0


class LeaseKind(enum.Enum):
    STANDING = "standing"  # what the replica keeps on the device between calls; never recalled
    CALL = "call"  # what a call adds; kept between calls as a reservation the ledger may recall


class GiveBack(enum.Enum):
    RECALLED = "recalled"  # the ledger asked: a neighbour waits for the bytes
    IDLE = "idle"  # no call for idle_s
    GROWING = "growing"  # a call needs more: give back, then wait for the larger lease
    CLOSING = "closing"  # replica shutdown


class DeviceLedger(Protocol):
    """What DeviceLeases needs of a device pool (cluster.replica.ledger_client.LedgerBudget, ledger_view.LocalBudget)."""

    def acquire(self, nbytes: int, owner: str, priority: float = 0.0, purpose: str = "", wait_s: float = 0.0,
                recallable: bool = False) -> Lease | Refusal: ...

    def resize(self, lease: Lease, nbytes: int, wait_s: float = 0.0) -> Lease | Refusal: ...

    def release(self, lease: Lease) -> None: ...

    def watch_recalls(self, owner: str, on_recall: Callable[[str], None]) -> None: ...


class LeaseRefused(RuntimeError):
    """A lease was not granted within its bounded wait; the caller maps it to DeviceBusy (503)."""

    def __init__(self, kind: LeaseKind, nbytes: int, refusal: Refusal, waited_s: float):
        self.kind, self.nbytes, self.refusal, self.waited_s = kind, nbytes, refusal, waited_s
        super().__init__(f"{kind.value} lease of {nbytes} B refused after {waited_s:.1f} s: {refusal.reason}")


@dataclass(frozen=True)
class LeaseFigures:
    """What a replica's leases did, for reports and benchmarks."""

    standing_bytes: int
    reserved_bytes: int  # the call reservation held now (0 when given back)
    calls: int
    calls_without_round_trip: int  # fitted the reservation held from an earlier call
    given_back: tuple[tuple[str, int], ...]  # (GiveBack value, times), every reason
    to_driver: int  # times the allocator's cache went back to the driver
    # The device's headroom by part (driver free, cached blocks, neighbours' outstanding leases),
    # measured when the figures were asked for with it (reports, not calls); None otherwise.
    headroom: Headroom | None = None

    def to_json(self) -> dict:
        said = {"standing_bytes": self.standing_bytes, "reserved_bytes": self.reserved_bytes, "calls": self.calls,
                "calls_without_round_trip": self.calls_without_round_trip, "given_back": dict(self.given_back),
                "to_driver": self.to_driver}
        if self.headroom is not None:
            said["headroom"] = self.headroom.to_json()
        return said


class _ProcessCalls:
    """Calls running in this process: the allocator's cache is process-wide, so it is emptied only
    when none runs (several replicas share a process in benchmarks and tests)."""

    def __init__(self):
        self._cond = threading.Condition()
        self._running = 0

    @contextlib.contextmanager
    def running(self):
        with self._cond:
            self._running += 1
        try:
            yield
        finally:
            with self._cond:
                self._running -= 1
                self._cond.notify_all()

    @contextlib.contextmanager
    def idle(self):
        """Wait until no call runs; none starts until the body is done."""
        with self._cond:
            self._cond.wait_for(lambda: self._running == 0)
            yield


PROCESS_CALLS = _ProcessCalls()


class DeviceLeases:
    """One replica's standing lease and call reservation on its device pool."""

    def __init__(self, ledger: DeviceLedger, owner: str, pool: str, *, idle_s: float = DEFAULT_IDLE_S,
                 to_driver: Callable[[], None] | None = None, headroom: Callable[[], Headroom] | None = None):
        if idle_s <= 0:
            raise ValueError(f"idle_s must be > 0, got {idle_s}")
        self.ledger, self.owner, self.pool, self.idle_s = ledger, owner, pool, idle_s
        self._to_driver = to_driver  # None: nothing to return (CPU)
        self._headroom = headroom  # the device's headroom now, for reports; None: not reported
        self._call_lock = threading.Lock()  # one call at a time; give-backs wait for it
        self._standing: Lease | None = None
        self._reservation: Lease | None = None
        self._last_used = time.monotonic()
        self._calls = self._fast = self._emptied = 0
        self._in_call = False
        self._given_back = {reason: 0 for reason in GiveBack}
        self._closed = threading.Event()
        ledger.watch_recalls(owner, self._on_recall)
        self._idler = threading.Thread(target=self._idle_loop, name=f"device-leases-{owner}", daemon=True)
        self._idler.start()

    # ---- the standing lease ---------------------------------------------------------------
    def hold_standing(self, nbytes: int, timeout_s: float) -> Lease | None:
        """Make the standing lease ``nbytes``: taken, grown (waits up to ``timeout_s``) or shrunk.

        Shrinking returns the allocator's cache to the driver first, so it is never called inside
        :meth:`call`. Raises LeaseRefused when a growth is not granted in time.
        """
        if self._in_call:
            raise RuntimeError(f"{self.owner}: resize the standing lease after the call, not inside it")
        nbytes = max(0, int(nbytes))
        current = self._standing.nbytes if self._standing is not None else 0
        if nbytes == current:
            return self._standing
        start = time.monotonic()
        if self._standing is None:
            got = self.ledger.acquire(nbytes, self.owner, 0.0, f"{LeaseKind.STANDING.value}:{self.owner}",
                                      wait_s=timeout_s)
        else:
            if nbytes < current:
                self._return_to_driver()
            got = self.ledger.resize(self._standing, nbytes, wait_s=timeout_s)
        if not got:
            raise LeaseRefused(LeaseKind.STANDING, nbytes, got, time.monotonic() - start)
        logger.info("%s: standing device lease %d B -> %d B (what the replica keeps between calls)",
                    self.owner, current, nbytes)
        self._standing = got
        return got

    # ---- calls ------------------------------------------------------------------------------
    @contextlib.contextmanager
    def call(self, nbytes: int, timeout_s: float, priority: float = 0.0):
        """Run the body under a call lease of at least ``nbytes``; no round trip when the reservation fits.

        Raises LeaseRefused when the bytes are not granted within ``timeout_s``.
        """
        if nbytes < 0 or timeout_s < 0:
            raise ValueError(f"nbytes and timeout_s must be >= 0, got {nbytes} B and {timeout_s} s")
        with self._call_lock:
            self._calls += 1
            reservation = self._reservation
            if reservation is not None and reservation.nbytes >= nbytes:
                self._fast += 1
            else:
                if reservation is not None:
                    self._give_back(GiveBack.GROWING)
                self._reservation = self._reserve(nbytes, timeout_s, priority)
            self._in_call = True
            try:
                with PROCESS_CALLS.running():
                    yield self._reservation
            finally:
                self._in_call = False
                self._last_used = time.monotonic()

    def _reserve(self, nbytes: int, timeout_s: float, priority: float) -> Lease:
        start = time.monotonic()
        got = self.ledger.acquire(nbytes, self.owner, priority, f"{LeaseKind.CALL.value}:{self.owner}",
                                  wait_s=timeout_s, recallable=True)
        waited = time.monotonic() - start
        if not got:
            logger.info("%s: call lease of %d B refused after %.2f s: %s", self.owner, nbytes, waited, got.reason)
            raise LeaseRefused(LeaseKind.CALL, nbytes, got, waited)
        if waited > 0.1:
            logger.info("%s: call lease of %d B granted after waiting %.2f s", self.owner, nbytes, waited)
        return got

    # ---- giving bytes back --------------------------------------------------------------------
    def _on_recall(self, lease_id: str) -> None:
        """The ledger asks ``lease_id`` back: give it back once no call of this replica uses it."""
        with self._call_lock:
            if self._reservation is not None and self._reservation.lease_id == lease_id:
                self._give_back(GiveBack.RECALLED)

    def _idle_loop(self) -> None:
        while not self._closed.wait(self.idle_s / 4):
            if self._reservation is None or time.monotonic() - self._last_used < self.idle_s:
                continue
            if self._call_lock.acquire(blocking=False):  # a call running now is not idle
                try:
                    if self._reservation is not None and time.monotonic() - self._last_used >= self.idle_s:
                        self._give_back(GiveBack.IDLE)
                finally:
                    self._call_lock.release()

    def _give_back(self, why: GiveBack) -> None:
        """Return the reservation: the allocator's cache to the driver first, then the lease. Call lock held."""
        lease, self._reservation = self._reservation, None
        self._return_to_driver()
        # Counted before the release: the release lets a waiting neighbour's call through, whose report must see it.
        self._given_back[why] += 1
        self.ledger.release(lease)
        logger.info("%s: call reservation of %d B given back (%s)", self.owner, lease.nbytes, why.value)

    def _return_to_driver(self) -> None:
        if self._to_driver is None:
            return
        with PROCESS_CALLS.idle():
            self._to_driver()
        self._emptied += 1

    def figures(self, with_headroom: bool = False) -> LeaseFigures:
        """What the leases did; ``with_headroom`` also measures the device's headroom (a report's
        cost, a memory_snapshot walk on CUDA: never asked on a call's path)."""
        headroom = self._headroom() if with_headroom and self._headroom is not None else None
        return LeaseFigures(self._standing.nbytes if self._standing else 0,
                            self._reservation.nbytes if self._reservation else 0, self._calls, self._fast,
                            tuple((why.value, n) for why, n in self._given_back.items()), self._emptied, headroom)

    def close(self) -> None:
        """Give everything back (replica shutdown)."""
        self._closed.set()
        with self._call_lock:
            if self._reservation is not None:
                self._give_back(GiveBack.CLOSING)
            if self._standing is not None:
                self._return_to_driver()
                self.ledger.release(self._standing)
                self._standing = None
