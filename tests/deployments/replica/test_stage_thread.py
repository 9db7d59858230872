"""The encoder's and decoder's calls run on their replica's one steady thread (deployments/replica/stage_thread.py)."""
from __future__ import annotations

import asyncio
import contextvars
import threading

import pytest

from deployments.replica.stage_thread import StageThread

REQUEST = contextvars.ContextVar("request", default=None)


def test_every_call_runs_on_the_stages_own_thread_with_the_callers_context():
    thread = StageThread("encode")

    async def calls():
        seen = []
        for request in ("a", "b", "c"):
            REQUEST.set(request)
            seen.append(await thread.call(lambda: (threading.current_thread().name, REQUEST.get())))
        return threading.current_thread().name, seen

    try:
        loop_thread, seen = asyncio.run(calls())
    finally:
        thread.close()
    assert len({name for name, _ in seen}) == 1, "the calls hopped threads"
    # The stage's own thread, not a pool's (Serve's AnyIO worker thread page-faulted every call in again).
    assert seen[0][0].startswith("stage-encode") and seen[0][0] != loop_thread
    assert [request for _, request in seen] == ["a", "b", "c"], "Serve's request context did not travel with the call"


def test_a_call_cancelled_before_it_started_never_runs_and_errors_reach_the_caller():
    thread = StageThread("decode")
    release, ran = threading.Event(), []

    async def scenario():
        first = asyncio.ensure_future(thread.call(release.wait, 5))
        second = asyncio.ensure_future(thread.call(ran.append, "second"))
        await asyncio.sleep(0.05)
        second.cancel()  # Serve cancels a request whose caller went away
        # The cancel reaches the executor's queue on the loop's next turn (asyncio's future chaining);
        # Serve's cancel arrives through the same loop while the thread is busy, so let it land first.
        while not second.done():
            await asyncio.sleep(0)
        release.set()
        assert await first
        with pytest.raises(asyncio.CancelledError):
            await second
        with pytest.raises(ZeroDivisionError):
            await thread.call(lambda: 1 / 0)
        await thread.call(ran.append, "third")

    try:
        asyncio.run(scenario())
    finally:
        thread.close()
    assert ran == ["third"]
