"""What each stage replica reports about itself: where its weights are, what it admits, its batch.

Built in the stage replica and sent to the application's residency board
(:mod:`deployments.replica.board`); read by the ingress for ``GET /v1/residency`` and
``GET /v1/models``. Plain frozen data: it crosses Ray's object store pickled.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from deployments.capacity.admission import StageAdmission
from deployments.capacity.batch_state import BatchState
from offload_core.planner.picture import PlanPicture


@dataclass(frozen=True)
class AdapterResidency:
    """One configured LoRA adapter of a Denoiser replica: its A/B bytes and where they live now
    (the replica's device while loaded, "host" once evicted under the adapters' device budget)."""

    name: str
    nbytes: int
    place: str  # "cuda:0", "cpu" (the device of a CPU replica) or "host"
    rank: int

    def to_json(self) -> dict:
        return {"name": self.name, "bytes": self.nbytes, "place": self.place, "rank": self.rank}


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
    # offload_core.host.budget_cap.HostMemoryStatus.to_json(): budget, leased, used, shared stores.
    host_memory: dict | None = None
    batch: BatchState | None = None  # the Denoiser's step batching; None for the stages that do not batch
    # cluster.replica.device_leases.LeaseFigures as JSON: standing and reserved bytes, calls without a round trip.
    leases: dict = field(default_factory=dict)
    # What the replica admits (activation models, room beside its weights); None before calibration.
    admission: StageAdmission | None = None
    # The plan drawn as data (GET /v1/residency/picture renders it): strips, predicted and measured
    # passes; made once after the warm-up. Not in to_json: the picture is its own route.
    picture: PlanPicture | None = field(default=None, compare=False)
    # The Denoiser's LoRA adapters (none elsewhere): their bytes and where each lives.
    loras: tuple[AdapterResidency, ...] = ()
    # The GPU type the replica plans for ("L4", "H100": its fleet profile's accelerator type, else the
    # GPU's name; "CPU" without one): on a mixed fleet one deployment's replicas differ by it.
    gpu_type: str | None = None
    # compile: blocks (deployments/replica/compile_stage.py's StageCompile.to_json()): the compiled
    # block classes per component and each bucket's shapes, compile seconds and graphs; None: eager.
    compile: dict | None = None

    def to_json(self) -> dict:
        return {"replica": self.replica, "stage": self.stage, "device": self.device, "gpu_type": self.gpu_type,
                "mode": self.mode,
                "plan": list(self.plan),
                "predicted_peak_bytes": self.predicted_peak_bytes,
                "last_device_peak_bytes": self.last_device_peak_bytes,
                "last_bytes_streamed": self.last_bytes_streamed, "weights": self.weights,
                "host_memory": self.host_memory, "leases": self.leases,
                "activation_room_bytes": None if self.admission is None else self.admission.room_bytes,
                # A tiling decoder's tile (deployments/models/vae_tiling.py): outputs beyond it decode tile by tile.
                **({"vae_tile_px": self.admission.tile} if self.admission is not None and self.admission.tile else {}),
                **({"batch": self.batch.to_json()} if self.batch is not None else {}),
                **({"loras": [lora.to_json() for lora in self.loras]} if self.loras else {}),
                "compile": self.compile or {"mode": "none"}}


# A replica sends its report again after this long without a change (one report: 2.5-6.6 ms of CPU
# on the tiny zoo), so a board that restarted empty knows every idle replica again within it.
REPUBLISH_S = 30.0
