"""The replica side of the node ledger: offload_core's MemoryBudget over the ledger actor.

One :class:`LedgerClient` per replica process remembers every lease it holds, so when the ledger
restarts (a new epoch, seen on any call or by the heartbeat) it re-registers them before asking
for more. :class:`LedgerBudget` is one pool of it seen as a ``MemoryBudget``; the engine never
knows its budget is shared.
"""
from __future__ import annotations

import logging
import threading
import uuid

import ray
from ray.exceptions import RayActorError
from tenacity import RetryCallState, Retrying, retry_if_exception_type, stop_after_delay, wait_exponential

from cluster.ledger.actor import LedgerConfig, StaleEpoch
from cluster.ledger.liveness import OwnerRef
from offload_core.host.budget import Lease, MemoryBudget, Refusal

logger = logging.getLogger(__name__)

# A restarting ledger is unreachable for ~1-3 s (a new worker process imports Ray and this
# package); 60 s covers a loaded node without letting a caller hang forever.
LEDGER_UNAVAILABLE_TIMEOUT_S = 60.0
CALL_TIMEOUT_S = 30.0  # one ledger call, beyond any wait the caller asked for
# A recall long poll returns at least this often, so a closed client's listener ends soon after.
RECALL_POLL_S = 5.0


class LedgerUnavailable(RuntimeError):
    """The node ledger did not answer within the bound (it is restarting too long, or gone)."""


def _unavailable(state: RetryCallState):
    exc = state.outcome.exception()
    raise LedgerUnavailable(f"node ledger unreachable for {LEDGER_UNAVAILABLE_TIMEOUT_S:.0f} s: {exc}") from exc


def call_through_restart(submit, extra_s: float = 0.0):
    """ray.get one ledger call, retrying while its actor is unavailable (0.05 s doubling to 1 s
    between tries) for up to LEDGER_UNAVAILABLE_TIMEOUT_S, then :class:`LedgerUnavailable`.

    ``submit(retry: bool)`` makes the call; ``retry`` is True when an earlier attempt may have
    run (Ray cannot tell after ActorUnavailableError), so the call can be made idempotent.
    """
    for attempt in Retrying(retry=retry_if_exception_type(RayActorError), wait=wait_exponential(0.05, max=1.0),
                            stop=stop_after_delay(LEDGER_UNAVAILABLE_TIMEOUT_S), retry_error_callback=_unavailable):
        with attempt:
            return ray.get(submit(attempt.retry_state.attempt_number > 1), timeout=CALL_TIMEOUT_S + extra_s)


class LedgerClient:
    """Everything one replica process holds from its node ledger."""

    def __init__(self, handle, owner: str, config: LedgerConfig = LedgerConfig()):
        self._handle, self._config = handle, config
        self.ref = OwnerRef.of_this_process(owner)
        self._held: dict[str, tuple[str, Lease]] = {}  # lease_id -> (pool, lease)
        self._lock = threading.RLock()
        self._closed = threading.Event()
        self._reregister_hooks: list = []  # run after leases are re-registered with a restarted ledger
        self._on_recall = None  # called with a recalled lease id, from the listener thread
        self._listener: threading.Thread | None = None
        self._watched: dict[str, list] = {}  # pool -> callbacks given its leases per process on each beat
        self._epoch = self._call(lambda retry: handle.epoch.remote())
        self._heartbeat = threading.Thread(target=self._beat, name=f"ledger-heartbeat-{owner}", daemon=True)
        self._heartbeat.start()

    @property
    def epoch(self) -> str:
        return self._epoch

    def budget(self, pool: str) -> "LedgerBudget":
        return LedgerBudget(self, pool)

    def state(self):
        return self._call(lambda retry: self._handle.state.remote())

    def request(self, pool: str, nbytes: int, owner: str, priority: float = 0.0, purpose: str = "",
                wait_s: float = 0.0, recallable: bool = False) -> Lease | Refusal:
        request_id = uuid.uuid4().hex  # a retried call gets the first call's answer, never a 2nd grant
        return self._held_answer(pool, wait_s, lambda epoch: self._handle.request.remote(
            pool, int(nbytes), self.ref, float(priority), purpose, epoch, float(wait_s), owner, request_id,
            bool(recallable)))

    def resize(self, pool: str, lease: Lease, nbytes: int, wait_s: float = 0.0) -> Lease | Refusal:
        """``lease`` at ``nbytes`` (same id); a growth waits up to ``wait_s`` for the added bytes."""
        with self._lock:
            if lease.lease_id not in self._held:
                raise KeyError(f"lease {lease.lease_id} of {lease.owner} is not held by this replica")
        request_id = uuid.uuid4().hex
        return self._held_answer(pool, wait_s, lambda epoch: self._handle.resize.remote(
            pool, lease.lease_id, int(nbytes), epoch, float(wait_s), request_id))

    def _held_answer(self, pool: str, wait_s: float, submit) -> Lease | Refusal:
        while True:
            epoch = self._epoch
            result = self._call(lambda retry: submit(epoch), extra_s=wait_s)
            if isinstance(result, StaleEpoch):
                self._reregister()
                continue
            if isinstance(result, Lease):
                with self._lock:
                    self._held[result.lease_id] = (pool, result)
            return result

    def watch_recalls(self, on_recall) -> None:
        """Call ``on_recall(lease_id)`` (from a listener thread) when the ledger asks a lease back."""
        with self._lock:
            self._on_recall = on_recall
            if self._listener is None:
                self._listener = threading.Thread(target=self._listen, name=f"ledger-recalls-{self.ref.owner}",
                                                  daemon=True)
                self._listener.start()

    def watch_pool(self, pool: str, on_figures) -> None:
        """Call ``on_figures(((pid, bytes), ...))`` with ``pool``'s leases per process now and on every
        heartbeat after (cluster/replica/neighbours.py): the heartbeat's one round trip carries them."""
        pulse = self._call(lambda retry: self._handle.pulse.remote((pool,)))
        on_figures(dict(pulse.leased_by_process)[pool])
        with self._lock:
            self._watched.setdefault(pool, []).append(on_figures)

    def release(self, pool: str, lease: Lease) -> None:
        with self._lock:
            if lease.lease_id not in self._held:
                raise KeyError(f"lease {lease.lease_id} of {lease.owner} is not held by this replica")
        while True:
            epoch = self._epoch
            # A retried release may find the first attempt already gave the lease back.
            stale = self._call(lambda retry: self._handle.release.remote(pool, lease.lease_id, epoch, retry))
            if not isinstance(stale, StaleEpoch):
                break
            self._reregister()
        with self._lock:
            self._held.pop(lease.lease_id, None)

    def call(self, method: str, *args):
        """A node-ledger method taking ``(*args, ref, client_epoch)`` (the weight-store calls), riding
        out a ledger restart: re-register, then ask again."""
        while True:
            epoch = self._epoch
            result = self._call(lambda retry: getattr(self._handle, method).remote(*args, self.ref, epoch))
            if not isinstance(result, StaleEpoch):
                return result
            self._reregister()

    def on_reregister(self, hook) -> None:
        """Run ``hook()`` whenever this client re-registers with a restarted ledger."""
        self._reregister_hooks.append(hook)

    def outstanding(self, pool: str, owner: str | None) -> tuple[Lease, ...]:
        return self._call(lambda retry: self._handle.outstanding.remote(pool, owner))

    def capacity(self, pool: str) -> int:
        return self._call(lambda retry: self._handle.capacity.remote(pool))

    def close(self) -> int:
        """Release everything this replica holds; stop the heartbeat. Returns the bytes given back."""
        self._closed.set()
        with self._lock:
            held = list(self._held.values())
        for pool, lease in held:
            self.release(pool, lease)
        return sum(lease.nbytes for _, lease in held)

    # ---- internals -------------------------------------------------------------------------
    def _call(self, submit, extra_s: float = 0.0):
        """ray.get one ledger call, riding out a ledger restart up to the bound (:func:`call_through_restart`)."""
        return call_through_restart(submit, extra_s)

    def _reregister(self) -> None:
        with self._lock:
            held = tuple(self._held.values())
            # Re-registered under the process's ref: all its leases share one liveness fate.
            new_epoch = self._call(lambda retry: self._handle.readopt.remote(held, self.ref))
            logger.info("ledger restarted (epoch %s -> %s): %s re-registered %d lease(s), %d B",
                        self._epoch, new_epoch, self.ref.owner, len(held), sum(l.nbytes for _, l in held))
            self._epoch = new_epoch
        for hook in self._reregister_hooks:
            hook()

    def _listen(self) -> None:
        while not self._closed.is_set():
            try:
                recalled = self._call(lambda retry: self._handle.recalls.remote(self.ref, RECALL_POLL_S),
                                      extra_s=RECALL_POLL_S)
            except LedgerUnavailable as exc:
                logger.info("recall poll of %s failed, polling again: %s", self.ref.owner, exc)
                continue
            for _pool, lease_id in recalled:
                with self._lock:
                    held, on_recall = lease_id in self._held, self._on_recall
                if held and on_recall is not None and not self._closed.is_set():
                    on_recall(lease_id)
            if recalled:  # the lease is given back in on_recall; don't spin on one not yet released
                self._closed.wait(0.01)

    def _beat(self) -> None:
        while not self._closed.wait(self._config.heartbeat_s):
            with self._lock:
                # Store attachments (a registry's hook) are held too: a restart must hear of them.
                holding = bool(self._held) or bool(self._reregister_hooks) or bool(self._watched)
                watched = {pool: tuple(hooks) for pool, hooks in self._watched.items()}
            if not holding:
                continue
            try:
                pulse = self._call(lambda retry: self._handle.pulse.remote(tuple(watched)))
            except LedgerUnavailable as exc:
                logger.info("ledger heartbeat of %s failed, retrying next beat: %s", self.ref.owner, exc)
                continue
            if pulse.epoch != self._epoch:
                self._reregister()
            for pool, figures in pulse.leased_by_process:
                for hook in watched[pool]:
                    hook(figures)


class LedgerBudget(MemoryBudget):
    """One pool of the node ledger as offload_core's MemoryBudget."""

    def __init__(self, client: LedgerClient, pool: str):
        self.client, self.pool = client, pool

    def request(self, nbytes: int, owner: str, priority: float = 0.0, purpose: str = "") -> Lease | Refusal:
        return self.client.request(self.pool, nbytes, owner, priority, purpose)

    def acquire(self, nbytes: int, owner: str, priority: float = 0.0, purpose: str = "",
                wait_s: float = 0.0, recallable: bool = False) -> Lease | Refusal:
        """Like request, but waits up to ``wait_s`` for the bytes to be released by others."""
        return self.client.request(self.pool, nbytes, owner, priority, purpose, wait_s, recallable)

    def resize(self, lease: Lease, nbytes: int, wait_s: float = 0.0) -> Lease | Refusal:
        return self.client.resize(self.pool, lease, nbytes, wait_s)

    def watch_recalls(self, owner: str, on_recall) -> None:
        """One replica per client: its recalls, whatever the lease's owner name."""
        self.client.watch_recalls(on_recall)

    def release(self, lease: Lease) -> None:
        self.client.release(self.pool, lease)

    def outstanding(self, owner: str | None = None) -> tuple[Lease, ...]:
        return self.client.outstanding(self.pool, owner)

    def capacity(self) -> int:
        return self.client.capacity(self.pool)
