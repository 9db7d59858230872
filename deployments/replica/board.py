"""Where each stage replica's weights are, collected for ``GET /v1/residency``.

A Serve handle reaches one replica per call, so each replica publishes its own report to one
small named actor per application after loading and after every call; the ingress reads it and
drops replicas that are no longer alive (a killed replica's actor name disappears).
"""
from __future__ import annotations

import dataclasses
import logging

import ray

from deployments.capacity.replica_report import BatchState, ReplicaResidency

logger = logging.getLogger(__name__)


# Restarted whenever it dies (its process killed, its node lost): it starts empty, and every replica
# sends its report again within REPUBLISH_S; meanwhile the ingress answers from what it has.
@ray.remote(num_cpus=0, max_restarts=-1)
class ResidencyBoard:
    def __init__(self):
        self._reports: dict[str, ReplicaResidency] = {}

    def publish(self, report: ReplicaResidency) -> None:
        self._reports[report.replica] = report

    def set_batch(self, replica: str, batch: BatchState) -> None:
        """The batch changed size: a small update that needs no walk of the weights."""
        if replica in self._reports:
            self._reports[replica] = dataclasses.replace(self._reports[replica], batch=batch)

    def snapshot(self, alive: frozenset[str]) -> tuple[ReplicaResidency, ...]:
        """Reports of the replicas in ``alive``; the others (killed, scaled down) are dropped for good."""
        for replica in set(self._reports) - alive:
            del self._reports[replica]
        return tuple(self._reports.values())


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
