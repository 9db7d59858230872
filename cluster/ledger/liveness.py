"""Who holds a lease, and whether they are still alive: observed, never trusted.

A lease owner is a process (a Serve replica is one Ray actor in one worker process). The ledger
checks the owner's process on the ledger's own node (pid plus its start time, so a recycled pid is
not mistaken for the owner); for an actor on another node, the GCS actor table (state DEAD, or a
restart: a restarted actor is a new process whose pins are gone).
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Iterable

import psutil

from compat.ray import actor_table_row

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class OwnerRef:
    """The process behind a lease owner."""

    owner: str  # the replica's name, as leases carry it
    node_id: str | None  # Ray node of the owner's process (None without Ray)
    actor_id: str | None  # Ray actor id (hex) when the owner is an actor, else None
    pid: int
    pid_started: float  # psutil create_time of ``pid``: tells a recycled pid from the owner
    restarts: int = 0  # the actor's NumRestarts when this ref was made; more later = a new process

    @classmethod
    def of_this_process(cls, owner: str) -> "OwnerRef":
        node_id = actor_id = None
        restarts = 0
        try:
            import ray
        except ImportError:  # offload_core users without Ray still get a process identity
            ray = None
        if ray is not None and ray.is_initialized():
            ctx = ray.get_runtime_context()
            node_id = ctx.get_node_id()
            actor_id = ctx.get_actor_id()
            if actor_id is not None:
                restarts = actor_info(actor_id).get("NumRestarts", 0)
        pid = os.getpid()
        return cls(owner, node_id, actor_id, pid, psutil.Process(pid).create_time(), int(restarts))


def actor_info(actor_id: str) -> dict:
    """The GCS actor table row of one actor ({} when unknown)."""
    # ray.util.state needs the dashboard (tests and many clusters run without it); the GCS actor
    # table is what Ray's own RuntimeContext.was_current_actor_reconstructed reads.
    return actor_table_row(actor_id)


def process_is_gone(ref: OwnerRef) -> bool:
    """True when the owner's process no longer exists (or its pid now names another process)."""
    try:
        return psutil.Process(ref.pid).create_time() != ref.pid_started
    except psutil.NoSuchProcess:
        return True


def actor_is_dead(ref: OwnerRef) -> bool:
    """True when the GCS says the owner's actor is DEAD, or restarted since the ref was made."""
    info = actor_info(ref.actor_id)
    if not info:
        return True  # unknown to the GCS: never created in this cluster, or long gone
    return info["State"] == "DEAD" or int(info.get("NumRestarts", 0)) > ref.restarts


def find_dead(refs: Iterable[OwnerRef], ledger_node_id: str | None) -> tuple[OwnerRef, ...]:
    """Owners that are observably dead. An owner whose liveness cannot be checked stays alive.

    An owner on the ledger's own node (every replica that leases from it) is judged by its process alone:
    while the process lives it holds what it pinned, whatever the GCS says (a killed actor's process may
    linger), and a restarted actor is a new process. The GCS is asked only about owners on other nodes:
    a lookup per owner per check was 3 GCS calls every 2 s from an idle app's ledger (bench/idle_app.py).
    """
    dead = []
    for ref in refs:
        if ref.node_id == ledger_node_id:
            if process_is_gone(ref):
                dead.append(ref)
            continue
        if ref.actor_id is None:
            continue
        try:
            if actor_is_dead(ref):
                dead.append(ref)
        except Exception as exc:  # a GCS hiccup must not reclaim a live replica's pins
            logger.info("liveness of %s (actor %s) unknown this round, kept: %r", ref.owner, ref.actor_id, exc)
    return tuple(dead)
