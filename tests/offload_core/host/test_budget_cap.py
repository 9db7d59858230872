"""A replica's own host budget: parsed from what a user writes, enforced as a cap on its leases."""
from __future__ import annotations

import pytest

from offload_core.host.budget import InProcessLedger, Lease, Refusal
from offload_core.host.budget_cap import CappedBudget, GiB, HostBudgetSpec, MiB, parse_host_budget


@pytest.mark.parametrize("value, spec", [
    ("16GiB", HostBudgetSpec(nbytes=16 * GiB)), ("512MiB", HostBudgetSpec(nbytes=512 * MiB)),
    ("20GB", HostBudgetSpec(nbytes=20 * 10**9)), ("1.5GiB", HostBudgetSpec(nbytes=int(1.5 * GiB))),
    (0.25, HostBudgetSpec(fraction=0.25)), ("0.5", HostBudgetSpec(fraction=0.5)),
    (4 * GiB, HostBudgetSpec(nbytes=4 * GiB)), ("0GiB", HostBudgetSpec(nbytes=0)),
    # One-letter units are binary (pydantic.ByteSize alone would read 16g as 16e9 B).
    ("16g", HostBudgetSpec(nbytes=16 * GiB)), (" 512 M ", HostBudgetSpec(nbytes=512 * MiB)),
])
def test_sizes_and_fractions_parse_to_bytes_or_a_share_of_spendable_ram(value, spec):
    assert parse_host_budget(value) == spec


@pytest.mark.parametrize("value, message", [
    ("16 parsecs", "not a size"), ("lots", "not a size"), ("16GiB of RAM", "not a size"), ("-5GiB", "not a size"), (1.5, r"\(0, 1\]"), (0.0, r"\(0, 1\]"),
    (16, "under 1 KiB"), (True, "size or a fraction"), (-5 * GiB, ">= 0"),
])
def test_a_budget_that_is_not_a_size_or_a_fraction_is_refused_with_what_to_write(value, message):
    with pytest.raises((ValueError, TypeError), match=message):
        parse_host_budget(value)


def test_a_fraction_resolves_against_the_nodes_spendable_ram():
    assert parse_host_budget(0.25).resolve(spendable=40 * GiB) == 10 * GiB
    assert parse_host_budget("3GiB").resolve(spendable=40 * GiB) == 3 * GiB


def test_the_cap_refuses_past_the_replicas_budget_even_when_the_node_has_room():
    node = InProcessLedger(10 * GiB)
    capped = CappedBudget(node, 3 * GiB)
    first = capped.request(2 * GiB, "r1")
    assert isinstance(first, Lease) and capped.available() == 1 * GiB
    refused = capped.request(2 * GiB, "r1")
    assert isinstance(refused, Refusal) and refused.available == 1 * GiB and "cap" in refused.reason
    assert node.leased() == 2 * GiB, "a refused request must not reach the node"
    capped.release(first)
    assert capped.leased() == 0 and node.leased() == 0 and capped.available() == 3 * GiB


def test_the_replica_plans_within_the_smaller_of_its_budget_and_what_the_node_grants():
    node = InProcessLedger(4 * GiB)
    neighbour = node.request(3 * GiB, "other replica")
    capped = CappedBudget(node, 3 * GiB)
    assert capped.available() == 1 * GiB, "the node has 1 GiB free: the cap cannot grant more than that"
    refused = capped.request(2 * GiB, "r1")
    assert isinstance(refused, Refusal) and refused.available == 1 * GiB
    node.release(neighbour)
    assert capped.available() == 3 * GiB
