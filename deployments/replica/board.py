"""Where each stage replica's weights are, collected for ``GET /v1/residency``.

A Serve handle reaches one replica per call, so each replica publishes its own report to one
small named actor per application after loading and after every call; the ingress reads it and
drops replicas that are no longer alive (a killed replica's actor name disappears).

The board keeps each report as the bytes the replica pickled (:func:`pack`) and the ingress
unpickles them (:func:`unpack`): a report's plan picture and admission import torch, which the
board's own process then never does (1.1 s of CPU at each application's start, measured on a quiet
2-core machine; 3 s under load).
"""
from __future__ import annotations

import dataclasses
import logging
import pickle
from typing import TYPE_CHECKING

import ray

from deployments.capacity.batch_state import BatchState

if TYPE_CHECKING:
    from deployments.capacity.replica_report import ReplicaResidency

logger = logging.getLogger(__name__)


def pack(report: ReplicaResidency) -> bytes:
    """A report as the board holds it (the stage replica's side)."""
    return pickle.dumps(report, protocol=pickle.HIGHEST_PROTOCOL)


def unpack(entry: tuple[bytes, BatchState | None]) -> ReplicaResidency:
    """A report from :meth:`ResidencyBoard.snapshot`, with its latest batch (the ingress's side)."""
    packed, batch = entry
    report = pickle.loads(packed)  # bytes this application's own replicas pickled
    return report if batch is None else dataclasses.replace(report, batch=batch)


# Restarted whenever it dies (its process killed, its node lost): it starts empty, and every replica
# sends its report again within REPUBLISH_S; meanwhile the ingress answers from what it has.
@ray.remote(num_cpus=0, max_restarts=-1)
class ResidencyBoard:
    def __init__(self):
        self._reports: dict[str, bytes] = {}  # pack()ed, never unpickled here
        self._batches: dict[str, BatchState] = {}  # sent after the report they update

    def publish(self, replica: str, report: bytes) -> None:
        self._reports[replica] = report
        self._batches.pop(replica, None)  # the report carries the batch of its own moment

    def set_batch(self, replica: str, batch: BatchState) -> None:
        """The batch changed size: a small update that needs no walk of the weights."""
        if replica in self._reports:
            self._batches[replica] = batch

    def snapshot(self, alive: frozenset[str]) -> tuple[tuple[bytes, BatchState | None], ...]:
        """Reports of the replicas in ``alive`` (for :func:`unpack`); the others (killed, scaled down)
        are dropped for good."""
        for replica in set(self._reports) - alive:
            del self._reports[replica]
            self._batches.pop(replica, None)
        return tuple((report, self._batches.get(replica)) for replica, report in self._reports.items())


def board_name(app_name: str) -> str:
    return f"offload-serve-residency:{app_name}"


def get_board(app_name: str):
    """The application's board, created on first use. Detached so it outlives any one replica."""
    return ResidencyBoard.options(name=board_name(app_name), namespace="serve", lifetime="detached",
                                  get_if_exists=True).remote()


# A tensor-parallel replica's rank actors are named with this prefix and their own id (the replica's
# id + "/rank<i>") in the "serve" namespace: each rank's report is kept while its actor lives.
RANK_ACTOR_PREFIX = "offload-tp-rank:"


def live_replicas() -> set[str]:
    names = {entry["name"] for entry in ray.util.list_named_actors(all_namespaces=True)
             if entry.get("namespace") == "serve"}
    return {name.removeprefix(RANK_ACTOR_PREFIX) for name in names}
