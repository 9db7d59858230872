"""The link probe's host memory is leased from the node's host pool while it runs, or the link is not measured."""
from __future__ import annotations

import logging
import threading
from types import SimpleNamespace

import pytest
import torch

from cluster.replica import plan
from cluster.replica.ledger_view import LocalBudget
from offload_core.planner.facts import LinkFacts
from offload_core.streaming.link import probe_host_bytes

CUDA0 = torch.device("cuda", 0)  # named only: nothing here touches a GPU
MiB = 1 << 20


def _memory(capacity: int) -> SimpleNamespace:
    return SimpleNamespace(owner="r", gpu_fraction=None, device_pool="host", node=SimpleNamespace(gpus=()),
                           host_budget=LocalBudget(capacity, "host"))


def test_the_probes_peak_is_the_fill_probe_or_the_link_probe_whichever_holds_more():
    assert probe_host_bytes(cache_bytes=0) == 64 * MiB * (1 + 16), "no cache size: the fill probe's 1 GiB source"
    assert probe_host_bytes(cache_bytes=32 * MiB) == 2 * 256 * MiB + 2 * 32 * MiB, "the link probe's 576 MiB"
    assert probe_host_bytes(cache_bytes=384 * MiB) == 64 * MiB * (1 + 13)


def test_the_probes_host_bytes_are_leased_from_the_node_while_they_run_and_given_back(monkeypatch):
    memory = _memory(4 << 30)
    held = []

    def measure(device, copier_cap=None):
        held.append([(lease.nbytes, lease.purpose) for lease in memory.host_budget.outstanding()])
        return LinkFacts(50e9, 8e9, measured=True)

    monkeypatch.setattr(plan, "measure_link", measure)
    monkeypatch.setattr(plan, "is_measured", lambda device, cap: False)
    assert plan.measured_link(memory, CUDA0).measured
    assert held == [[(probe_host_bytes(), "link probe")]]
    assert memory.host_budget.outstanding() == (), "the lease outlived the probe"


def test_a_probe_that_fails_gives_its_lease_back(monkeypatch):
    memory = _memory(4 << 30)

    def measure(device, copier_cap=None):
        raise RuntimeError("CUDA error: out of memory")

    monkeypatch.setattr(plan, "measure_link", measure)
    monkeypatch.setattr(plan, "is_measured", lambda device, cap: False)
    with pytest.raises(RuntimeError, match="out of memory"):
        plan.measured_link(memory, CUDA0)
    assert memory.host_budget.outstanding() == ()


def test_a_node_without_room_for_the_probes_plans_with_the_gpu_tables_link_and_says_why(monkeypatch, caplog):
    memory = _memory(probe_host_bytes() - 1)
    monkeypatch.setattr(plan, "PROBE_WAIT_S", 0.2)
    monkeypatch.setattr(plan, "measure_link", lambda *a, **k: pytest.fail("measured without its host memory"))
    monkeypatch.setattr(plan, "is_measured", lambda device, cap: False)
    with caplog.at_level(logging.INFO, logger="cluster.replica.plan"):
        facts = plan.measured_link(memory, CUDA0)
    assert facts == plan.link_facts(gpu=None) and not facts.measured
    assert "link not measured: its probes need" in caplog.text and "the GPU table's link figures" in caplog.text


def test_a_link_this_process_measured_already_takes_no_lease(monkeypatch):
    memory = _memory(0)  # nothing to lease: a second stage in the process must not wait on the pool
    facts = LinkFacts(50e9, 8e9, measured=True)
    monkeypatch.setattr(plan, "measure_link", lambda device, copier_cap=None: facts)
    monkeypatch.setattr(plan, "is_measured", lambda device, cap: True)
    monkeypatch.setattr(plan, "PROBE_WAIT_S", 5.0)
    assert plan.measured_link(memory, CUDA0) is facts


def test_a_replica_starting_beside_a_probing_neighbour_waits_for_its_bytes_and_then_measures(monkeypatch):
    memory = _memory(probe_host_bytes())
    neighbour = memory.host_budget.request(probe_host_bytes(), "neighbour", purpose="link probe")
    threading.Timer(0.3, memory.host_budget.release, (neighbour,)).start()
    monkeypatch.setattr(plan, "measure_link", lambda device, copier_cap=None: LinkFacts(50e9, 8e9, measured=True))
    monkeypatch.setattr(plan, "is_measured", lambda device, cap: False)
    assert plan.measured_link(memory, CUDA0).measured, "planned with the table while the neighbour's bytes came back"
    assert memory.host_budget.outstanding() == ()
