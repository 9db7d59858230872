"""A replica's way to the node's weight stores: :class:`LedgerStoreRegistry`, offload_core's
``StoreRegistry`` over the node ledger actor, for one replica process; it re-registers its
attachments when the ledger restarts. The ledger's record of the stores is
``offload_core/shared_store/ledger_record.py``. Run by each stage replica.
"""
from __future__ import annotations

import logging
import threading

from tenacity import Retrying, retry_if_result, stop_after_delay, wait_exponential

from offload_core.host.budget import Refusal
from offload_core.shared_store.files import StoreKey
from offload_core.shared_store.ledger_record import StoreWait
from offload_core.shared_store.registry import (
    CREATE_WAIT_S,
    StoreAttachment,
    StoreRegistry,
    StoreTicket,
)

logger = logging.getLogger(__name__)


class LedgerStoreRegistry(StoreRegistry):
    """offload_core's StoreRegistry over the node ledger, for one replica process."""

    def __init__(self, client):
        self._client = client  # cluster.replica.ledger_client.LedgerClient
        # digest -> one (component, path, nbytes, budget) per attachment this process holds
        self._held: dict[str, list[tuple]] = {}
        self._lock = threading.Lock()
        client.on_reregister(self._reregister)

    def acquire(self, key: StoreKey, nbytes: int, path: str, owner: str,
                budget_bytes: int | None = None) -> StoreTicket | Refusal:
        # While another replica writes the store, ask again (0.05 s doubling to 0.5 s) up to CREATE_WAIT_S.
        attach = Retrying(retry=retry_if_result(lambda got: isinstance(got, StoreWait)),
                          wait=wait_exponential(0.05, max=0.5), stop=stop_after_delay(CREATE_WAIT_S),
                          retry_error_callback=lambda state: Refusal(
                              owner, nbytes, 0, f"store {key.digest} still being written after {CREATE_WAIT_S} s"))
        got = attach(self._client.call, "store_attach", key.digest, key.component, path, int(nbytes), budget_bytes)
        if isinstance(got, StoreTicket):
            with self._lock:
                self._held.setdefault(key.digest, []).append((key.component, path, int(nbytes), budget_bytes))
        return got

    def ready(self, key: StoreKey, owner: str) -> None:
        self._client.call("store_ready", key.digest)

    def release(self, key: StoreKey, owner: str) -> None:
        with self._lock:
            held = self._held.get(key.digest, [])
            if held:
                held.pop()
            if not held:
                self._held.pop(key.digest, None)
        self._client.call("store_detach", key.digest)

    def attachment(self, key: StoreKey) -> StoreAttachment | None:
        return self._client.call("store_attachment", key.digest)

    def _reregister(self) -> None:
        with self._lock:
            held = [(digest, entry) for digest, entries in self._held.items() for entry in entries]
        for digest, (component, path, nbytes, budget) in held:
            self._client.call("store_readopt", digest, component, path, nbytes, budget)
        if held:
            logger.info("re-registered %d store attachment(s) with the restarted ledger", len(held))
