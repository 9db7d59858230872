"""The stage lifecycle of a pipeline's components, and what each request measured.

``PipelineResidency.apply(components, plan, device)`` leases the plan's host tiers and builds one
unit per component under its strategy (``residency.components``). A stage then runs between
``prepare_for_use(stage_components)`` and ``finish_use(stage_components)``; ``finish_request()``
closes the request and returns what it measured: device weight bytes at peak (kept from every bind,
release and move of every component) and host->device bytes moved, which the plan predicts exactly.
Runs in the process that holds the pipeline (a stage replica, ``offload-serve`` locally).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator, Mapping, Sequence

import torch
from torch import nn

from offload_core.host.budget import InProcessLedger, MemoryBudget
from offload_core.planner.pipeline_plan import PipelinePlan
from offload_core.planner.strategy import Strategy
from offload_core.residency.components import ComponentUnit, UseState, build_units
from offload_core.residency.host_fit import host_leases as _host_leases
from offload_core.residency.host_fit import tiers_as_hosted
from offload_core.streaming.device import normalize_device
from offload_core.streaming.meter import WeightTotal
from offload_core.tables import HostTablesConfig

__all__ = ["LifecycleError", "PipelineResidency", "RequestFigures", "Strategy", "UseState"]


class LifecycleError(RuntimeError):
    """A lifecycle call out of order (finish before prepare, prepare twice)."""


@dataclass(frozen=True)
class RequestFigures:
    """What one request measured."""

    peak_device_bytes: int  # distinct device storages of all components' parameters, at peak
    bytes_moved: int  # host->device bytes: streamed and resident layers, restores


class PipelineResidency:
    """Every component of a pipeline under its plan, and the lifecycle of its stages."""

    def __init__(self, components: dict[str, ComponentUnit], plan: PipelinePlan, device: torch.device,
                 hosting, budget: MemoryBudget | None):
        self.components = components
        self.plan = plan
        self.device = device
        self._hosting, self._budget = hosting, budget  # hosting.HostingPlan and its one lease
        self.shared = None  # SharedWeights: the node stores its streamed layers are hosted from
        self._removed = False
        # While following calls (``following_calls``): the hooks on each out component's modules.
        self._follow: dict[str, list] | None = None
        # The sampler: every component's meter reports each change to one total (O(1), no hooks).
        self._weights = WeightTotal()
        for c in components.values():
            c.meter.report_to(self._weights)
        self.finish_request()

    @classmethod
    def apply(cls, components: Mapping[str, nn.Module], plan: PipelinePlan, device: torch.device | str,
              budget: MemoryBudget | None = None, *, owner: str = "pipeline",
              tables: HostTablesConfig = HostTablesConfig(),
              host_budget_bytes: int | None = None, shared=None) -> PipelineResidency:
        """Put each component under its plan; with a host ``budget``, its tiers are leased (and fitted) first.

        ``host_budget_bytes``: this replica's own host-memory budget (a user's ``host_memory_budget``);
        the tiers are then fitted within min(it, what ``budget`` grants), and a budget below what
        every plan holds raises :class:`~offload_core.host.budget_cap.BudgetTooSmall`.
        ``shared``: a :class:`~offload_core.shared_store.hosting.SharedWeights`; streamed components
        it covers are hosted from node weight stores (one copy per node), detached on ``remove``.
        """
        missing = {c.name for c in plan.components} ^ set(components)
        if missing:
            raise ValueError(f"plan and components disagree on {sorted(missing)}")
        device = normalize_device(device)
        if host_budget_bytes is not None and budget is None:
            budget = InProcessLedger(host_budget_bytes, f"{owner}-host")
        try:
            plan, hosting, budget, shared_hosts = _host_leases(plan, components, budget, owner, host_budget_bytes,
                                                               shared, device)
            built = build_units(components, plan, device, tables, shared_hosts)
        except BaseException:
            if shared is not None:  # a replica that failed to start must not stay counted on a store
                shared.close()
            raise
        plan = tiers_as_hosted(plan, {n: c.streamer for n, c in built.items() if c.streamer is not None})
        for cplan in plan.components:
            built[cplan.name].plan = cplan
        residency = cls(built, plan, device, hosting, budget)
        residency.shared = shared
        return residency

    # -- the lifecycle ------------------------------------------------------------------------
    def prepare_for_use(self, stage_components: Sequence[str]) -> None:
        """Before a stage: restore parked weights, arm resident layers, issue the first copies."""
        try:
            for c in self._pick(stage_components):
                if c.state is UseState.IN_USE:
                    raise LifecycleError(f"{c.name} is already in use: finish_use it before preparing it again")
                c.prepare()
                c.state = UseState.IN_USE
        finally:
            self._refollow()

    def finish_use(self, stage_components: Sequence[str]) -> None:
        """After a stage: release every streamed layer first, then park non-layer weights if the gate says so.

        Releasing the whole stage before any gate runs gives each gate the headroom the stage
        leaves behind (the planner predicts the gates in the same order).
        """
        picked = self._pick(stage_components)
        for c in picked:
            if c.state is not UseState.IN_USE:
                raise LifecycleError(f"{c.name} is {c.state.value}, not in use: nothing to finish")
        try:
            for c in picked:
                c.finish()
                c.state = UseState.OUT
        finally:
            self._refollow()
        for c in picked:
            c.gate()

    def in_use(self, name: str) -> bool:
        """Whether component ``name`` is prepared for use now (between its prepare and its finish)."""
        return self.components[name].state is UseState.IN_USE

    @contextlib.contextmanager
    def following_calls(self) -> Iterator[None]:
        """Drive the lifecycle from the pipeline's own calls (one ``pipe(...)`` runs every stage).

        The first call into any module of a component that is out finishes the components of
        other stages still in use and prepares the component's whole stage. Hooks are prepended,
        so they run before the engine's layer hooks.

        Only components that are out carry them: on a component in use they would do nothing at
        every module's forward, yet any Python hook sends torch's module call down its slow path
        (Wan2.1-14B's structure, 1,138 modules, CPU: 30.5 ms per forward hooked, 22.9 ms not: ~190 us
        per streamed layer on the launch thread). Preparing a component drops its hooks; finishing
        it, while calls are followed, puts them back.
        """
        if self._follow is not None:
            yield  # nested (or a use whose block was never closed): the active block keeps the hooks
            return
        self._follow = {}
        try:
            self._refollow()
            yield
        finally:
            follow, self._follow = self._follow, None
            for handles in follow.values():
                for handle in handles:
                    handle.remove()

    def _refollow(self) -> None:
        """While following calls: hooks on every module of each component that is out, none on those in use.

        Called after every state change (also from inside a hook: torch iterates over a copy of a
        module's hooks, so removing them there is safe)."""
        follow = self._follow
        if follow is None:
            return
        for name, c in self.components.items():
            if c.state is UseState.IN_USE:
                for handle in follow.pop(name, ()):
                    handle.remove()
            elif name not in follow:
                follow[name] = [m.register_forward_pre_hook(lambda *_, name=name: self._enter(name), prepend=True)
                                for m in c.module.modules()]

    def _enter(self, name: str) -> None:
        if self.components[name].state is UseState.IN_USE:
            return
        stage = self.plan.stage_of(name)
        others = [n for n, c in self.components.items() if c.state is UseState.IN_USE and n not in stage.components]
        if others:
            self.finish_use(others)
        self.prepare_for_use([n for n in stage.components if self.components[n].state is not UseState.IN_USE])

    @contextlib.contextmanager
    def stage(self, stage_components: Sequence[str]) -> Iterator[None]:
        self.prepare_for_use(stage_components)
        try:
            yield
        finally:
            self.finish_use(stage_components)

    def bytes_moved(self) -> int:
        """Host->device bytes moved since the last ``finish_request`` (a running counter)."""
        return sum(c.bytes_moved() for c in self.components.values())

    def finish_request(self) -> RequestFigures:
        """Close a request: finish what is still in use, report its figures, reset for the next."""
        open_ = [c.name for c in self.components.values() if c.state is not UseState.OUT]
        if open_:
            for name in open_:
                self.components[name].state = UseState.IN_USE
            self.finish_use(open_)
        figures = RequestFigures(self._weights.peak, self.bytes_moved())
        for c in self.components.values():
            c.reset_counters()
        self._weights.reset_peak()
        return figures

    # -- what the device holds ----------------------------------------------------------------
    def device_bytes_now(self) -> int:
        """Weight bytes of every component on the device now (between uses: what is kept).

        Kept from the engine's binds and releases and parking's moves: O(1), no walk.
        """
        return self._weights.current

    def report(self):
        from offload_core.residency.report import residency_report

        return residency_report({n: c.module for n, c in self.components.items()},
                                streamers={n: c.streamer for n, c in self.components.items() if c.streamer},
                                parkings={n: c.parking for n, c in self.components.items() if c.parking},
                                tables={n: c.table_decisions for n, c in self.components.items()},
                                device=self.device)

    def host_leased_bytes(self) -> int:
        """Bytes of this pipeline's one host lease (its net anonymous hosting cost); 0 without one."""
        return self._hosting.lease.nbytes if self._hosting is not None else 0

    def remove(self) -> None:
        """Undo everything: hooks, streamers, host tables; give the host lease back. A second call does nothing
        (a replica closed explicitly is closed again by its ``__del__``)."""
        if self._removed:
            return
        self._removed = True
        for c in self.components.values():
            c.remove()
        if self._hosting is not None:
            self._hosting.release(self._budget)
            self._hosting = None
        if self.shared is not None:
            shared, self.shared = self.shared, None
            shared.close()

    def _pick(self, names: Sequence[str]) -> list[ComponentUnit]:
        unknown = [n for n in names if n not in self.components]
        if unknown:
            raise KeyError(f"unknown components {unknown}; this pipeline has {sorted(self.components)}")
        return [self.components[n] for n in names]
