"""The two waits a replica rides out without Ray: a restarting ledger actor, a store another replica writes."""
from __future__ import annotations

import pytest
from ray.exceptions import RayActorError

from cluster.ledger import shared_stores
from cluster.ledger.shared_stores import LedgerStoreRegistry
from cluster.replica import ledger_client
from cluster.replica.ledger_client import LedgerUnavailable, call_through_restart
from offload_core.host.budget import Refusal
from offload_core.shared_store.files import StoreKey, StoreRole
from offload_core.shared_store.ledger_record import StoreWait
from offload_core.shared_store.registry import StoreTicket


@pytest.fixture
def no_sleep(monkeypatch):
    """tenacity's waits, recorded instead of slept."""
    waits: list[float] = []
    monkeypatch.setattr("tenacity.nap.time.sleep", waits.append)
    return waits


def test_a_call_rides_out_an_unavailable_actor_and_says_later_tries_may_repeat_the_first(monkeypatch, no_sleep):
    outcomes = iter([RayActorError(), RayActorError(), "answer"])

    def get(value, timeout):
        outcome = next(outcomes)
        if isinstance(outcome, Exception):
            raise outcome
        return value + outcome

    monkeypatch.setattr(ledger_client.ray, "get", get)
    retries: list[bool] = []
    assert call_through_restart(lambda retry: retries.append(retry) or "the ") == "the answer"
    assert retries == [False, True, True], "only the first try is known not to have run before"
    assert no_sleep == [0.05, 0.1], "the backoff starts at 0.05 s and doubles"


def test_a_ledger_unavailable_past_the_bound_is_ledger_unavailable(monkeypatch, no_sleep):
    def get(value, timeout):
        raise RayActorError()

    monkeypatch.setattr(ledger_client.ray, "get", get)
    monkeypatch.setattr(ledger_client, "LEDGER_UNAVAILABLE_TIMEOUT_S", 0.0)
    with pytest.raises(LedgerUnavailable, match="unreachable"):
        call_through_restart(lambda retry: None)


def test_errors_other_than_an_unavailable_actor_are_not_retried(monkeypatch, no_sleep):
    def get(value, timeout):
        raise ValueError("a bug, not a restart")

    monkeypatch.setattr(ledger_client.ray, "get", get)
    with pytest.raises(ValueError, match="a bug"):
        call_through_restart(lambda retry: None)
    assert no_sleep == []


class _Client:
    def __init__(self, answers):
        self.answers, self.calls = iter(answers), 0

    def on_reregister(self, hook):
        pass

    def call(self, method, *args):
        self.calls += 1
        return next(self.answers)


KEY = StoreKey("model-folder", "transformer", "float32", "l" * 16)


def test_an_attacher_waits_while_the_store_is_written_then_attaches(no_sleep):
    ticket = StoreTicket(StoreRole.ATTACH, 2)
    client = _Client([StoreWait(KEY.digest), StoreWait(KEY.digest), ticket])
    assert LedgerStoreRegistry(client).acquire(KEY, 1024, "/dev/shm/x", "r2") == ticket
    assert client.calls == 3 and no_sleep == [0.05, 0.1]


def test_an_attacher_gives_up_with_a_refusal_after_the_create_wait(monkeypatch, no_sleep):
    monkeypatch.setattr(shared_stores, "CREATE_WAIT_S", 0.0)
    got = LedgerStoreRegistry(_Client([StoreWait(KEY.digest)] * 3)).acquire(KEY, 1024, "/dev/shm/x", "r2")
    assert isinstance(got, Refusal) and "still being written" in got.reason
