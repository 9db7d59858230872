"""Liveness is observed, not trusted: a gone process (or a recycled pid) is dead; unknown stays alive."""
from __future__ import annotations

import dataclasses
import subprocess
import sys

from cluster.ledger.liveness import OwnerRef, find_dead, process_is_gone


def test_a_live_process_is_alive_and_an_exited_one_is_dead():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        import psutil

        ref = OwnerRef("child", "node-a", None, child.pid, psutil.Process(child.pid).create_time())
        assert not process_is_gone(ref)
        assert find_dead([ref], "node-a") == ()
    finally:
        child.kill()
        child.wait()
    assert process_is_gone(ref) and find_dead([ref], "node-a") == (ref,)


def test_a_recycled_pid_is_not_mistaken_for_the_owner():
    me = OwnerRef.of_this_process("me")
    assert not process_is_gone(me)
    assert process_is_gone(dataclasses.replace(me, pid_started=me.pid_started - 100.0))


def test_a_process_on_another_node_is_not_judged_by_this_node_pids():
    elsewhere = OwnerRef("remote", "node-b", None, 2**22 + 12345, 0.0)  # no such local pid
    assert find_dead([elsewhere], "node-a") == (), "without an actor id nothing proves it dead: keep it"


def test_an_owner_on_the_ledgers_node_is_judged_by_its_process_without_asking_the_gcs(monkeypatch):
    from cluster.ledger import liveness

    asked = []
    monkeypatch.setattr(liveness, "actor_info", lambda actor_id: asked.append(actor_id) or {"State": "DEAD"})
    me = dataclasses.replace(OwnerRef.of_this_process("me"), node_id="node-a", actor_id="a1")
    assert find_dead([me], "node-a") == (), "a live process still holds its pins, whatever the GCS says"
    gone = dataclasses.replace(me, owner="gone", pid_started=me.pid_started - 100.0)
    assert find_dead([gone], "node-a") == (gone,)
    assert asked == [], "the GCS was asked about an owner whose process this node sees"
    elsewhere = dataclasses.replace(me, owner="remote", node_id="node-b", actor_id="b1")
    assert find_dead([elsewhere], "node-a") == (elsewhere,) and asked == ["b1"]
