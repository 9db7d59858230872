"""Where each stage replica's weights are, collected for ``GET /v1/residency``.

A Serve handle reaches one replica per call, so each replica publishes its own report to one
small named actor per application after loading and after every call; the ingress reads it and
drops replicas that are no longer alive (a killed replica's actor name disappears).
"""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field

import ray

from deployments.capacity.limits import StageAdmission

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class BatchState:
    """A batching replica's batch right now: requests in the running forward, and the mean so far."""

    size: int
    mean: float
    max: int

    def to_json(self) -> dict:
        return {"size": self.size, "mean": round(self.mean, 3), "max": self.max}


@dataclass(frozen=True)
class ReplicaResidency:
    """One replica's report: its stage, device, offload mode and per-component placements."""

    replica: str  # Serve's full replica id, which is also its actor name
    stage: str
    device: str
    mode: str
    plan: tuple[str, ...]  # the planner's explanation: one line for the plan, one per component
    predicted_peak_bytes: int
    last_device_peak_bytes: int
    last_bytes_streamed: int
    # offload_core.residency.report's ResidencyReport.to_json(): bytes per place per component, each byte once.
    weights: dict
    # offload_core.host.replica_budget.HostMemoryStatus.to_json(): budget, leased, used, shared stores.
    host_memory: dict | None = None
    batch: BatchState | None = None  # the Denoiser's step batching; None for the stages that do not batch
    # cluster.device_leases.LeaseFigures as JSON: standing and reserved bytes, calls without a round trip.
    leases: dict = field(default_factory=dict)
    # What the replica admits (activation models, room beside its weights); None before calibration.
    admission: StageAdmission | None = None

    def to_json(self) -> dict:
        return {"replica": self.replica, "stage": self.stage, "device": self.device, "mode": self.mode,
                "plan": list(self.plan),
                "predicted_peak_bytes": self.predicted_peak_bytes,
                "last_device_peak_bytes": self.last_device_peak_bytes,
                "last_bytes_streamed": self.last_bytes_streamed, "weights": self.weights,
                "host_memory": self.host_memory, "leases": self.leases,
                "activation_room_bytes": None if self.admission is None else self.admission.room_bytes,
                **({"batch": self.batch.to_json()} if self.batch is not None else {})}


# A replica sends its report again after this long without a change (one report: 2.5-6.6 ms of CPU
# on the tiny zoo), so a board that restarted empty knows every idle replica again within it.
REPUBLISH_S = 30.0


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


def live_replicas() -> set[str]:
    return {entry["name"] for entry in ray.util.list_named_actors(all_namespaces=True)
            if entry.get("namespace") == "serve"}
