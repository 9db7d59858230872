"""The ledger's accounting without Ray: no over-commit, caps, priority-ordered bounded waits, reclaim."""
from __future__ import annotations

import asyncio
import random

import pytest

from cluster.ledger.liveness import OwnerRef
from cluster.ledger.pools import LeasePools
from offload_core.host.budget import Lease, Refusal


def _ref(name: str, pid: int = 1) -> OwnerRef:
    return OwnerRef(name, "node", None, pid, 0.0)


def run(coro):
    return asyncio.run(coro)


def test_concurrent_requests_never_over_commit_a_pool():
    async def scenario():
        pools = LeasePools({"gpu:0": 1000})
        refs = [_ref(f"r{i}", i) for i in range(20)]
        rng = random.Random(0)

        async def replica(ref):
            for _ in range(10):
                got = await pools.request("gpu:0", rng.randint(50, 400), ref, wait_s=0.05)
                if isinstance(got, Lease):
                    await asyncio.sleep(rng.random() / 100)
                    pools.release("gpu:0", got.lease_id)

        await asyncio.gather(*(replica(r) for r in refs))
        return pools.states()[0]

    state = run(scenario())
    assert state.peak_leased <= state.capacity == 1000
    assert state.peak_leased > 600, "the pool must actually have been contended"
    assert state.leased == 0 and state.waiters == 0


def test_a_waiter_is_granted_when_bytes_are_released_and_refused_after_its_bound():
    async def scenario():
        pools = LeasePools({"gpu:0": 100})
        held = await pools.request("gpu:0", 80, _ref("a"))
        waiting = asyncio.ensure_future(pools.request("gpu:0", 50, _ref("b"), wait_s=5))
        await asyncio.sleep(0.01)
        pools.release("gpu:0", held.lease_id)
        granted = await waiting
        timed_out = await pools.request("gpu:0", 80, _ref("c"), wait_s=0.05)
        return granted, timed_out

    granted, timed_out = run(scenario())
    assert isinstance(granted, Lease) and granted.nbytes == 50
    assert isinstance(timed_out, Refusal) and "after waiting" in timed_out.reason and timed_out.available == 50


def test_waiters_are_served_by_priority_then_first_come():
    async def scenario():
        pools = LeasePools({"gpu:0": 100})
        held = await pools.request("gpu:0", 100, _ref("holder"))
        order = []

        async def wait(name, priority):
            got = await pools.request("gpu:0", 60, _ref(name), priority=priority, wait_s=5)
            order.append(name)
            await asyncio.sleep(0.01)
            pools.release("gpu:0", got.lease_id)

        tasks = [asyncio.ensure_future(wait("decoder-first", 1.0)), asyncio.ensure_future(wait("encoder", 1.0))]
        await asyncio.sleep(0.01)
        tasks.append(asyncio.ensure_future(wait("denoiser", 50.0)))  # bytes x 50 uses: outranks both
        await asyncio.sleep(0.01)
        # A newcomer that would fit later must not jump the queue of equal or higher priority.
        assert isinstance(await pools.request("gpu:0", 1, _ref("newcomer"), priority=1.0), Refusal)
        pools.release("gpu:0", held.lease_id)
        await asyncio.gather(*tasks)
        return order

    assert run(scenario()) == ["denoiser", "decoder-first", "encoder"]


def test_the_per_owner_cap_counts_all_of_one_process_leases():
    async def scenario():
        pools = LeasePools({"host": 1000}, owner_caps={"host": 400})
        me = _ref("replica", 7)
        first = await pools.request("host", 300, me, owner="replica/transformer")
        second = await pools.request("host", 200, me, owner="replica/text_encoder")
        other = await pools.request("host", 400, _ref("other", 8))
        return first, second, other

    first, second, other = run(scenario())
    assert isinstance(first, Lease) and isinstance(other, Lease)
    assert isinstance(second, Refusal) and "per-replica cap" in second.reason
    assert second.available == 100, "a refusal reports what this owner could still get, cap included"


def test_reclaiming_a_dead_owner_frees_its_leases_and_serves_waiters():
    async def scenario():
        pools = LeasePools({"host": 100, "gpu:0": 100})
        dead = _ref("dead", 1)
        await pools.request("host", 70, dead)
        await pools.request("gpu:0", 90, dead)
        waiting = asyncio.ensure_future(pools.request("gpu:0", 50, _ref("alive", 2), wait_s=5))
        await asyncio.sleep(0.01)
        freed = pools.reclaim(dead, "test: process gone")
        return freed, await waiting, pools

    freed, granted, pools = run(scenario())
    assert freed == 160 and pools.reclaimed_bytes == 160
    assert isinstance(granted, Lease) and pools.owners() == {_ref("alive", 2)}


def test_readopted_leases_are_recorded_even_past_capacity():
    async def scenario():
        pools = LeasePools({"host": 100})
        lease = Lease("host-old-1", "holder", 80, 0.0, "pinned")
        pools.readopt((("host", lease),), _ref("holder"))
        return pools, await pools.request("host", 30, _ref("late", 2))

    pools, late = run(scenario())
    assert pools.outstanding("host") == (Lease("host-old-1", "holder", 80, 0.0, "pinned"),)
    assert isinstance(late, Refusal), "bytes a replica still holds must not be granted again"


def test_bad_requests_are_named():
    pools = LeasePools({"host": 100})
    with pytest.raises(KeyError, match="no pool 'gpu:3'"):
        run(pools.request("gpu:3", 1, _ref("x")))
    with pytest.raises(ValueError, match="nbytes must be >= 0"):
        run(pools.request("host", -1, _ref("x")))
    with pytest.raises(KeyError, match="not outstanding"):
        pools.release("host", "host-nope")
    assert "larger than the whole pool" in run(pools.request("host", 101, _ref("x"))).reason


def test_a_lease_grows_and_shrinks_in_place_and_a_growth_waits_for_the_added_bytes():
    async def scenario():
        pools = LeasePools({"gpu:0": 100})
        mine = await pools.request("gpu:0", 40, _ref("a"))
        other = await pools.request("gpu:0", 50, _ref("b"))
        grown_now = await pools.resize("gpu:0", mine.lease_id, 50)
        refused = await pools.resize("gpu:0", mine.lease_id, 60)
        growing = asyncio.ensure_future(pools.resize("gpu:0", mine.lease_id, 70, wait_s=5))
        await asyncio.sleep(0.01)
        assert not growing.done(), "20 B more cannot fit while b holds 50 of 100"
        pools.release("gpu:0", other.lease_id)
        grown_later = await growing
        shrunk = await pools.resize("gpu:0", mine.lease_id, 10)
        return grown_now, refused, grown_later, shrunk, pools.states()[0]

    grown_now, refused, grown_later, shrunk, state = run(scenario())
    assert (grown_now.nbytes, grown_later.nbytes, shrunk.nbytes) == (50, 70, 10)
    assert grown_now.lease_id == grown_later.lease_id == shrunk.lease_id, "a resize keeps the lease's id"
    assert isinstance(refused, Refusal) and refused.nbytes == 10, "the refusal names the bytes added"
    assert state.leased == 10 and state.peak_leased <= 100


def test_a_waiting_request_recalls_other_owners_reservations_largest_first_and_only_enough():
    async def scenario():
        pools = LeasePools({"gpu:0": 100})
        small = await pools.request("gpu:0", 20, _ref("a"), recallable=True)
        big = await pools.request("gpu:0", 50, _ref("b"), recallable=True)
        standing = await pools.request("gpu:0", 30, _ref("c"))
        polled = asyncio.ensure_future(pools.recalls(_ref("b"), timeout_s=5))
        await asyncio.sleep(0)
        waiting = asyncio.ensure_future(pools.request("gpu:0", 40, _ref("d"), wait_s=5))
        recalled_b = await polled
        recalled_a = await pools.recalls(_ref("a"), timeout_s=0.01)
        assert not waiting.done(), "a recall asks; the bytes stay leased until the holder gives them back"
        pools.release("gpu:0", big.lease_id)
        granted = await waiting
        return recalled_b, recalled_a, granted, standing, small, pools

    recalled_b, recalled_a, granted, standing, small, pools = run(scenario())
    assert recalled_b == (("gpu:0", recalled_b[0][1]),) and recalled_b[0][1].startswith("gpu:0-")
    assert recalled_a == (), "50 B recalled from b cover the 40 B asked: a keeps its reservation"
    assert isinstance(granted, Lease) and granted.nbytes == 40
    assert pools.recalls_sent == 1


def test_a_standing_lease_is_never_recalled():
    async def scenario():
        pools = LeasePools({"gpu:0": 100})
        await pools.request("gpu:0", 90, _ref("a"))
        refused = await pools.request("gpu:0", 40, _ref("b"), wait_s=0.05)
        return refused, await pools.recalls(_ref("a"), timeout_s=0.01), pools.recalls_sent

    refused, recalled, sent = run(scenario())
    assert isinstance(refused, Refusal) and recalled == () and sent == 0
