"""One stage replica's components under offload_core: planned, applied, measured, reported.

The planner (``offload_core.planner.search.plan_pipeline``, through ``cluster.replica.plan``) turns
the components' facts, the replica's device capacity (its pool of the node ledger) and the stage's
offload mode (left open: the fleet profile's for the GPU the replica got, always within that
profile's limits) into one explainable plan; ``offload_core.residency.lifecycle.PipelineResidency``
applies it and runs the stage lifecycle. The plan is logged once per component by offload_core and returned as JSON by ``/v1/residency``.
"""
from __future__ import annotations

import logging
from typing import Mapping, Sequence

import torch
from torch import nn

from cluster.replica.ledger_view import ReplicaMemory
from cluster.replica.plan import host_lease_bytes, plan_stage
from offload_core.host.budget import MemoryBudget
from offload_core.host.budget_cap import HostMemoryStatus
from offload_core.planner.search import (
    PerformanceMode,
    PipelinePlan,
)
from offload_core.quant import WeightFormat
from offload_core.residency.lifecycle import PipelineResidency, RequestFigures
from offload_core.shared_store.hosting import SharedWeights
from offload_core.tables import HostTablesConfig

logger = logging.getLogger(__name__)

def predicted_kept_bytes(plan: PipelinePlan) -> int:
    """Device weight bytes the plan keeps between calls: resident components, unparked non-layer weights."""
    return sum(c.prediction.idle_bytes for c in plan.components if c.prediction is not None)


class StageResidency:
    """The components of one stage replica under their plan; call around every stage use."""

    def __init__(self, stage: str, components: Mapping[str, nn.Module], uses_per_request: Mapping[str, int],
                 mode: PerformanceMode | None, device: torch.device, *, device_capacity: int,
                 host_budget: MemoryBudget, owner: str, host_budget_bytes: int | None = None,
                 shared: SharedWeights | None = None, memory: ReplicaMemory | None = None,
                 plan: PipelinePlan | None = None, expected_batch: float = 1.0,
                 phases: Sequence[Sequence[str]] | None = None,
                 weights: WeightFormat = WeightFormat.NATIVE,
                 tables: HostTablesConfig = HostTablesConfig()):
        """``plan``: made beforehand with :func:`plan_stage` (a replica plans, leases what the plan keeps
        on the device, then applies it); None: planned here. ``phases``: see :func:`stage_phases`."""
        self.device = device
        self.host_budget_bytes = host_budget_bytes
        self._names = tuple(components)
        wanted = plan or plan_stage(stage, components, uses_per_request, mode, device, device_capacity,
                                    host_lease_bytes(host_budget, host_budget_bytes), memory,
                                    expected_batch, phases, weights, tables)
        self.mode = wanted.mode  # the fleet profile's when the stage's configuration left it open
        self._residency = PipelineResidency.apply(components, wanted, device, host_budget, owner=owner,
                                                  host_budget_bytes=host_budget_bytes, shared=shared, tables=tables)
        # As applied: tiers the host budget lowered or the driver refused to pin are in it, with notes.
        self.plan = self._residency.plan
        self._last = RequestFigures(0, 0)
        # Phases (Wan2.2 A14B's experts): a use prepares the first; the first call into another
        # phase's module finishes the one in use and prepares it (PipelineResidency.following_calls),
        # so residency changes at the expert switch and one expert's working set is on the device.
        self._phases = [s.components for s in self.plan.stages]
        self._following = None
        self._last_by_component: dict[str, int] = {}

    def adopt(self, plan: PipelinePlan) -> None:
        """Show ``plan`` (the applied decisions re-predicted from measurements) as this residency's plan."""
        if [c.decisions() for c in plan.components] != [c.decisions() for c in self.plan.components]:
            raise ValueError("a plan with other decisions must be applied, not adopted: "
                             + "; ".join(plan.changes_from(self.plan)))
        self.plan = self._residency.plan = plan

    def prepare_for_use(self) -> None:
        if len(self._phases) < 2:
            self._residency.prepare_for_use(self._names)
            return
        self._residency.prepare_for_use(self._phases[0])
        self._following = self._residency.following_calls()
        self._following.__enter__()

    def finish_use(self) -> None:
        if self._following is None:
            self._residency.finish_use(self._names)
        else:
            self._following.__exit__(None, None, None)
            self._following = None
            self._residency.finish_use([n for n in self._names if self._residency.in_use(n)])
        # Before finish_request resets the counters: each component's bytes (Wan2.2 A14B: each expert's).
        self._last_by_component = {n: self._residency.components[n].bytes_moved() for n in self._names}
        self._last = self._residency.finish_request()

    def bytes_streamed_by_component(self) -> dict[str, int]:
        """Host->device weight bytes the last use moved, per component."""
        return dict(self._last_by_component)

    def bytes_streamed_so_far(self) -> int:
        """Host->device weight bytes moved in the use now running (a counter; step batching splits it)."""
        return self._residency.bytes_moved()

    def bytes_streamed(self) -> int:
        """Host->device weight bytes the last use moved (streamed and resident layers, restores)."""
        return self._last.bytes_moved

    def device_peak_bytes(self) -> int:
        """Peak device weight bytes measured during the last use."""
        return self._last.peak_device_bytes

    def predicted_peak_bytes(self) -> int:
        return self.plan.peak_device_bytes

    def kept_bytes(self) -> int:
        """Weight bytes on the device now: between calls, what the replica keeps (its standing lease)."""
        return self._residency.device_bytes_now()

    def report(self):
        """``offload_core.residency.report.ResidencyReport``: bytes per place per component, each byte once."""
        return self._residency.report()

    def host_status(self, report) -> HostMemoryStatus:
        """Budget, leased and used host bytes of this replica (``report``: its residency report)."""
        used = report.total("host_pinned_bytes") + report.total("host_pageable_bytes") + report.total("parked_bytes")
        shared = self._residency.shared
        attachments = tuple(a.to_json() for a in shared.attachments()) if shared is not None else ()
        return HostMemoryStatus(self.host_budget_bytes, self._residency.host_leased_bytes(), used, attachments)

    def remove(self) -> None:
        """Unhook everything and give the pinned lease back."""
        self._residency.remove()
