"""One stage replica's worker: loads the stage, plans and applies offload_core, leases, measures.

Each replica loads only its stage's components from the configured folder, plans them against its
share of the GPU, leases what it keeps on the device (a standing lease, before anything moves
there), runs them under offload_core (:class:`deployments.replica.stage_residency.StageResidency`), leases what
each call adds (a reservation kept between calls: no ledger round trip when the next call fits),
calibrates the stage's activation model and publishes its residency. The Serve deployments
(``deployments.replica.stages``) wrap one worker each.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import threading
import time
from typing import Callable

import ray
import torch
from ray import serve
from ray.serve.exceptions import RayServeException

from cluster.replica.ledger_view import DeviceBusy
from cluster.replica.plan import replan_stage
from deployments.capacity.admission import StageAdmission, nearest_admitted, size_text
from deployments.capacity.batch_state import BatchState
from deployments.capacity.replica_report import REPUBLISH_S, AdapterResidency, ReplicaResidency
from deployments.models import activation_features, families
from deployments.replica import compile_stage, warmup
from deployments.replica import worker_setup as setup
from deployments.replica.board import get_board, pack
from deployments.replica.board_publisher import Throttled
from deployments.replica.first_use import FirstUse
from deployments.replica.leases import (
    LEASE_REFUSED,
    hold_standing_at_start,
    open_device_leases,
    open_replica_memory,
)
from deployments.replica.load_tracker import gpu_type_of
from deployments.replica.metrics import ReplicaGauges, StageMetrics
from deployments.replica.priority import check_niceness
from deployments.replica.rank_spec import RankSpec
from deployments.replica.stage_config import DTYPES, StageConfig  # noqa: F401 (re-exported: importers name it here)
from deployments.replica.stage_residency import StageResidency, predicted_kept_bytes
from deployments.wire.spec import (
    GenerationSpec,
    PipelineStage,
    RequestRejected,
    StageOutput,
    StageStats,
)
from offload_core.host.budget import Refusal
from offload_core.planner.activation_model import ACTIVATION_MARGIN
from offload_core.planner.measured_compute import MeasuredCompute
from offload_core.planner.picture import PlanPicture, plan_picture
from offload_core.planner.search import repredict
from offload_core.streaming.headroom import HeadroomTimeout

logger = logging.getLogger(__name__)

# Residency reports reach the board at most this often per replica (and always within it + the settle).
PUBLISH_INTERVAL_S = 1.0
# A call pokes the report's publisher just before its answer leaves; waiting this long first keeps the
# report's CPU (it holds the GIL) off the answer's way out: 10x a hop, a tenth of the interval.
PUBLISH_SETTLE_S = 0.1
def _replica_device() -> torch.device:
    # A replica is on the GPU only when Ray gave it one (num_gpus > 0, fractions allowed).
    if torch.cuda.is_available() and ray.get_gpu_ids():
        return torch.device("cuda", 0)
    return torch.device("cpu")


def replica_id(stage: PipelineStage) -> str:
    try:
        return serve.get_replica_context().replica_id.to_full_id_str()
    except (RuntimeError, RayServeException):  # constructed outside Serve (benchmarks, unit tests of a worker)
        return f"local-{stage.value}"


class StageWorker:
    """Loads one stage, runs its calls under offload_core and the device lease, publishes residency."""

    def __init__(self, config: StageConfig, rank: RankSpec | None = None):
        """``rank``: this worker is one rank of a tensor-parallel replica (its process group formed):
        it loads its slice, and leases, plans and reports as its own replica ``rank.worker_id``."""
        self.config = config
        self.device = _replica_device()
        self.replica = rank.worker_id if rank is not None else replica_id(config.stage)
        check_niceness(config.niceness, self.replica)
        # The start, step by step (deployments/replica/worker_setup.py): load, open the ledger view,
        # plan provisionally, lease what the plan keeps, apply it; then warm up and plan again.
        self.pipe = setup.load_pipeline(config, rank)
        # The Denoiser's LoRA adapters, read and checked now (a misfit fails the start before any lease);
        # their device bytes are standing memory beside what the plan keeps.
        self.lora_adapters = setup.read_loras(config, self.pipe, self.replica)
        self.lora_device_bytes = setup.lora_device_bytes(self.lora_adapters, DTYPES[config.dtype])
        self.lora_bytes = min(sum(self.lora_device_bytes.values()), config.lora_device_budget)
        self.memory = open_replica_memory(self.replica, self.device)
        budget = setup.host_budget_bytes(config, self.memory, self.replica)
        self.leases = open_device_leases(self.memory, self.device)
        modules = families.stage_modules(self.pipe, config.facts, config.stage)
        plan = setup.provisional_plan(config, modules, self.device, self.memory, budget)
        # What the plan keeps on the device is leased before applying it moves anything there.
        # Refused (neighbours' calls hold the GPU): it waits, STARTING and listed as pending, never a crash loop.
        hold_standing_at_start(self.leases, predicted_kept_bytes(plan) + self.lora_bytes, config.device_timeout_s,
                               self.memory.device_budget.capacity(), self.replica)
        shared = setup.shared_weights(config, modules, self.memory, self.replica, budget, rank)
        self._applier = setup.residency_applier(config, modules, self.device, self.memory, self.replica, budget,
                                                shared)
        self.residency = self._applier(plan=plan)
        self.loras = setup.lora_set(config, self.pipe, self.device, self.lora_adapters, self.replica)
        self.activations: activation_features.StageActivations | None = None
        self.metrics = StageMetrics(config.stage.value)
        self.gauges = ReplicaGauges(config.stage.value, f"{(self.memory.node.node_id or 'local')[:8]}/{self.memory.device_pool}")
        # One call at a time per replica: the pipeline object (scheduler state) is not reentrant. A report
        # takes the lock too (it walks the weights a call moves), so whether a call runs is its own flag.
        self._lock = threading.Lock()
        self._in_call = False
        self._last = StageStats(config.stage.value, self.replica, 0.0, 0, 0)
        self._batch = None if config.batching is None else BatchState(0, 0.0, config.batching.max_batch)
        self._board = None
        # Reports are built after the response is on its way (PUBLISH_SETTLE_S after the call): one
        # reads /proc/self/maps and walks every tensor (2.5-17 ms of CPU per report on the tiny zoo,
        # more on a 14B model), taken from the next stage of the same request on a 2-core node.
        # Sent again after REPUBLISH_S without a change too: a board that restarted (empty) learns an
        # idle replica's report within that time.
        self._publisher = Throttled(self.publish, PUBLISH_INTERVAL_S, f"publish-{config.stage.value}", sent_now=True,
                                    keepalive_s=REPUBLISH_S, settle_s=PUBLISH_SETTLE_S)
        # The batch size goes on its own (no lock, no walk of the weights): a busy period holds the
        # call lock for as long as its batch runs, and a report waits for that lock.
        self._batch_sender = Throttled(self._send_batch, PUBLISH_INTERVAL_S, f"batch-{config.stage.value}")
        self.picture = None
        self.first_use = FirstUse(self.replica, modules, self.device)  # nothing to time during the warm-up
        self.warmup = self._apply_warmup(warmup.warm_up(self, modules, plan))
        # Compiled after the residency settled, before first-use timing starts (compile is no compute).
        self.compiled = None if config.compile is None else compile_stage.apply_stage_compile(
            self, modules, config.compile, self.warmup.shape, self.warmup.batch)
        if self.compiled is not None:
            self.metrics.record_compile(self.compiled.figures)
        # Components the warm-up's request did not run are timed on the first call that runs them.
        self.first_use.track(dict(self.warmup.compute))
        # Drawn from the plan that runs and what the warm-up measured (GET /v1/residency/picture).
        self.picture = self._picture()
        self.publish()

    @property
    def busy(self) -> bool:
        """A call holds this replica (its pipeline and its device working set). Not the lock: a report being
        built holds it too, for 2.5-17 ms every second while calls ran, and read as a call that never ended."""
        return self._in_call

    def run(self, work: Callable[[], object], spec: GenerationSpec | None = None) -> StageOutput:
        if spec is not None:
            self.admit(spec)
        started_at, start = time.time(), time.perf_counter()
        with self.in_use(self.activation_bytes(spec)):
            value = work()
        stats = StageStats(self.config.stage.value, self.replica, time.perf_counter() - start,
                           self.residency.bytes_streamed(), self.residency.device_peak_bytes(), started_at=started_at)
        self.record(stats)
        return StageOutput(value, stats)

    def activation_bytes(self, spec: GenerationSpec | None, batch: int = 1) -> int:
        """Predicted activation peak of a call at ``spec`` (``batch`` such requests together), at most
        what the share leaves beside the weights; 0 before calibration."""
        if spec is None or self.activations is None:
            return 0
        predicted = self.activations.predict(dataclasses.replace(spec, n=spec.n * batch))
        return min(math.ceil(ACTIVATION_MARGIN * predicted), self.activation_room())

    def activation_room(self) -> int:
        """What the replica's share of its GPU leaves for a call's activations beside its weights."""
        return max(0, self.memory.share_bytes - self.residency.predicted_peak_bytes())

    def admission(self) -> StageAdmission | None:
        """What this replica admits (published to the board: GET /v1/models states limits from it)."""
        if self.activations is None:
            return None
        return StageAdmission(self.config.stage, self.activation_room(), tuple(self.activations.models.items()),
                              self.activations.tile)

    def admit(self, spec: GenerationSpec) -> None:
        """Refuse (4xx naming the limit) a request whose activations can never fit the replica's share;
        one that does not fit now waits for its lease and may get 503 instead."""
        # Adapters apply in the Denoiser alone: the encoder and the decoder see the request's
        # adapter and carry on (checked here, every stage refused every adapter request over Serve).
        applies = self.config.stage is PipelineStage.DENOISE
        if applies and spec.lora is not None and spec.lora not in {lora.name for lora in self.config.loras}:
            raise RequestRejected("lora", f"unknown LoRA adapter {spec.lora!r}; this replica serves "
                                          f"{sorted(lora.name for lora in self.config.loras)}", status=404)
        admission = self.admission()
        if admission is None or admission.admits(self.config.facts, spec):
            return
        need, room = admission.need_bytes(self.config.facts, spec), admission.room_bytes
        logger.info("%s: request %s refused: %d B of activations > %d B room", self.replica, spec.request_id,
                    need, room)
        nearest = nearest_admitted(admission, self.config.facts, spec)
        raise RequestRejected(nearest.param(spec), (
            f"{spec.width}x{spec.height}x{spec.num_frames} (n={spec.n}) needs {size_text(need)} of "
            f"activations in the {self.config.stage.value} stage; this deployment serves at most "
            f"{size_text(room)} there ({size_text(self.memory.share_bytes)} share of {self.memory.device_pool}, "
            f"{size_text(self.residency.predicted_peak_bytes())} of weights); {nearest.describe(spec)}; "
            f"GET /v1/models states the limits"))

    @contextlib.contextmanager
    def in_use(self, activation_bytes: int = 0):
        """One use of the stage: the call lock, the call lease (weights it adds + ``activation_bytes``),
        prepare ... finish.

        No ledger round trip when the call fits the reservation kept from the last one; after
        the call the standing lease follows what the parking gate left on the device (rare).
        """
        with self._lock:
            self._in_call = True
            try:
                with self._call_lease(activation_bytes):
                    self.residency.prepare_for_use()
                    try:
                        with self.first_use.timed():
                            yield
                    finally:
                        self.residency.finish_use()
                        self.metrics.record_components(self.residency.bytes_streamed_by_component())
                    kept = self.residency.kept_bytes()
                self.leases.hold_standing(kept + self.lora_bytes, self.config.device_timeout_s)
            finally:
                self._in_call = False
        measured = self.first_use.take_changed()
        if measured is not None:
            self._replan(measured)
        self._publisher.poke()

    def record(self, stats: StageStats) -> None:
        self.metrics.record(stats)
        self._last = stats
        # Also here, not only when the use ends: the Denoiser records a request after its batch's
        # busy period, and the report published then showed the previous request's peak.
        self._publisher.poke()

    def call_bytes(self, activation_bytes: int = 0) -> int:
        """What a call adds on the device beyond the standing lease: streamed slots, restores, activation_features."""
        kept = self.leases.figures().standing_bytes - self.lora_bytes  # the adapters' share is theirs alone
        return max(0, self.residency.predicted_peak_bytes() - kept) + activation_bytes

    @contextlib.contextmanager
    def _call_lease(self, activation_bytes: int):
        """Hold the call lease (bounded wait, then DeviceBusy -> 503); no ledger round trip when it is kept."""
        try:
            with self.leases.call(self.call_bytes(activation_bytes), self.config.device_timeout_s) as lease:
                yield lease
        except LEASE_REFUSED as exc:
            raise DeviceBusy(self.replica, self.memory.device_pool, exc.nbytes, exc.refusal, exc.waited_s) from None
        except HeadroomTimeout as exc:  # a neighbour's lease kept the slots out: busy, as a refused lease
            refusal = Refusal(self.replica, exc.nbytes, exc.headroom.usable_bytes, str(exc))
            raise DeviceBusy(self.replica, self.memory.device_pool, exc.nbytes, refusal, exc.waited_s) from None

    def _apply_warmup(self, outcome: warmup.WarmupOutcome) -> warmup.WarmupOutcome:
        """Keep the warm-up's calibrated activations and its plan: re-applied if it changed, else adopted
        (the applied residency keeps its weights and reports the re-predicted figures)."""
        start = time.perf_counter()
        self.activations = outcome.activations
        if outcome.changes:
            self._reapply(lambda: self._applier(plan=outcome.plan), predicted_kept_bytes(outcome.plan))
        else:
            self.residency.adopt(outcome.plan)
        outcome = dataclasses.replace(outcome, seconds=outcome.seconds + time.perf_counter() - start)
        logger.info("%s: warm-up in %.2f s; %s; plan %s", self.replica, outcome.seconds, outcome.note,
                    f"changed ({'; '.join(outcome.changes)}): re-applied" if outcome.changes
                    else "unchanged: the applied one is kept")
        return outcome

    def _replan(self, compute: dict[str, MeasuredCompute]) -> None:
        """Plan the stage again with ``compute`` (a component measured on first use), keeping the
        warm-up's working set; re-applied only when a decision changed."""
        plan = self.residency.plan
        replanned = replan_stage(plan, self.memory, compute=compute, working_set_bytes=plan.facts.working_set_bytes)
        changes = replanned.changes_from(plan)
        if changes:
            self._reapply(lambda: self._applier(plan=replanned), predicted_kept_bytes(replanned))
        else:
            self.residency.adopt(repredict(plan, replanned.facts, (
                "compute per use measured on first use: " + ", ".join(
                    f"{name} {m.per_use_s * 1e3:.2f} ms" for name, m in compute.items()),)))
        self.warmup = dataclasses.replace(self.warmup, compute=tuple(compute.items()))
        self.picture = self._picture()
        logger.info("%s: planned again with the compute measured on first use: %s", self.replica,
                    f"changed ({'; '.join(changes)}): re-applied" if changes else "unchanged: the applied one is kept")

    def _reapply(self, make: Callable[[], StageResidency], kept: int) -> None:
        """Replace the applied residency with another, never holding more device bytes than leased.

        The standing lease grows before the new plan allocates and shrinks only after the old
        residency is gone (``hold_standing`` returns the allocator's cache to the driver first). Parked
        weights the old residency restores on its removal are within the call reservation the warm-up
        calls kept (it covers the old plan's peak).
        """
        timeout_s = self.config.device_timeout_s
        if kept + self.lora_bytes > self.leases.figures().standing_bytes:
            self.leases.hold_standing(kept + self.lora_bytes, timeout_s)
        with self._lock:  # no call or report running
            self.residency.remove()
            self.residency = make()
        self.leases.hold_standing(self.residency.kept_bytes() + self.lora_bytes, timeout_s)

    def _picture(self) -> PlanPicture | None:
        """The plan that runs, drawn as data with the warm-up's measured pass (None: a plan without facts)."""
        plan = self.residency.plan
        if plan.facts is None:
            logger.info("%s: no picture of the plan: it carries no facts to draw from", self.replica)
            return None
        return plan_picture(plan, dict(self.warmup.compute), title=f"{self.config.stage.value} replica "
                            f"{self.replica} on {self.device} ({gpu_type_of(self.memory)}): "
                            f"{plan.explain()[0].split(':')[0]}")

    def report(self) -> ReplicaResidency:
        weights = self.residency.report()
        return ReplicaResidency(self.replica, self.config.stage.value, str(self.device), self.residency.mode.value,
                                self.residency.plan.explain() + ((self.compiled.describe(),) if self.compiled else ()),
                                self.residency.predicted_peak_bytes(),
                                self._last.device_peak_bytes, self._last.bytes_streamed, weights.to_json(),
                                self.residency.host_status(weights).to_json(), self._batch,
                                self.leases.figures(with_headroom=True).to_json(), self.admission(), self.picture,
                                loras=self._lora_report(), gpu_type=gpu_type_of(self.memory),
                                compile=self.compiled.to_json() if self.compiled else None)

    def adapters_fit(self, names: set[str]) -> bool:
        """Whether the adapters ``names`` fit the adapters' device budget together (one forward needs them all)."""
        return sum(self.lora_device_bytes[name] for name in names) <= self.config.lora_device_budget

    def _lora_report(self) -> tuple[AdapterResidency, ...]:
        """Every configured adapter: on the device while loaded, on the host once evicted."""
        if self.loras is None:
            return ()
        loaded = {entry.name: entry for entry in self.loras.loaded()}
        return tuple(AdapterResidency(a.name, loaded[a.name].nbytes, str(loaded[a.name].device), a.rank)
                     if a.name in loaded else AdapterResidency(a.name, a.nbytes, "host", a.rank)
                     for a in self.lora_adapters)

    def set_batch(self, size: int, mean: float) -> None:
        """The Denoiser's batch size; the board gets it within PUBLISH_INTERVAL_S when it changed."""
        changed = self._batch is not None and self._batch.size != size
        self._batch = BatchState(size, mean, self.config.batching.max_batch)
        if changed:
            self._batch_sender.poke()

    def _send_batch(self) -> None:
        if ray.is_initialized():
            self._board = self._board or get_board(self.config.app_name)
            self._board.set_batch.remote(self.replica, self._batch)  # fire and forget

    def close(self) -> None:
        """Replica shutdown: unhook the engine and give back every lease this replica holds."""
        self._publisher.close()
        self._batch_sender.close()
        self.residency.remove()
        if self.loras is not None:
            self.loras.close()
        self.leases.close()
        logger.info("%s: shut down, released %d B of leases", self.replica, self.memory.close())

    def publish(self) -> None:
        if not ray.is_initialized():
            return
        if self._board is None:
            self._board = get_board(self.config.app_name)
        with self._lock:  # never while a call is moving the weights the report walks
            report = self.report()
        self._board.publish.remote(report.replica, pack(report))  # fire and forget: a report is not worth a wait
        self.gauges.record(report.weights["totals"], report.leases["standing_bytes"], report.leases["reserved_bytes"],
                           self.memory.share_bytes, self.memory.device_budget.capacity())
