"""Component residency: each component kept per its plan's strategy, and the stage lifecycle.

``PipelineResidency.apply(components, plan, device)`` puts every component in its strategy:
RESIDENT (moved once), MODEL_OFFLOAD (starts parked on the host, in for its stage, out after)
or LAYERWISE (the streaming engine, with optional parking of non-layer weights and host-gathered
token tables). A stage then runs between ``prepare_for_use(stage_components)`` and
``finish_use(stage_components)``; ``finish_request()`` closes the request and returns what it
measured: device weight bytes at peak (kept from every bind, release and move of every component) and
host->device bytes moved, which the plan predicts exactly.
"""
from __future__ import annotations

import contextlib
import enum
import logging
from dataclasses import dataclass
from typing import Iterator, Mapping, Sequence

import torch
from torch import nn

from compat.torch import own_buffers
from offload_core.host.budget import InProcessLedger, MemoryBudget
from offload_core.planner.pipeline_plan import ComponentPlan, PipelinePlan
from offload_core.planner.strategy import Strategy
from offload_core.residency.host_fit import host_leases as _host_leases
from offload_core.residency.host_fit import tiers_as_hosted
from offload_core.residency.host_tables import HostTables
from offload_core.residency.parking import Parking
from offload_core.streaming.device import normalize_device
from offload_core.streaming.engine import ResidentPlacement, StreamingConfig, apply_layer_streaming
from offload_core.streaming.meter import DeviceWeightMeter, WeightTotal
from offload_core.tables import HostTablesConfig, select_host_tables
from offload_core.tensor_parallel.sharded import move_unsharded

logger = logging.getLogger(__name__)

__all__ = ["LifecycleError", "PipelineResidency", "RequestFigures", "Strategy", "UseState"]


def streaming_config(plan: ComponentPlan) -> StreamingConfig:
    """The engine's configuration for one LAYERWISE component of a plan."""
    assert plan.strategy is Strategy.LAYERWISE, f"{plan.name} is {plan.strategy.value}, not streamed"
    # The plan lists its layers in the execution order it was made with; the engine streams them
    # in that order (and checks the keys), so "resident_layers leading" means the same layers to both.
    return StreamingConfig(layer_groups=plan.layer_groups or None, prefetch_depth=plan.prefetch_depth,
                           resident=plan.resident_layers, resident_placement=ResidentPlacement.LEADING,
                           keep_resident=False, hosting=dict(plan.hosting),
                           layer_order=tuple(key for key, _ in plan.hosting), weights=plan.weights,
                           # once per request: no prefetch into a next use the request never makes
                           wrap_uses=plan.uses_per_request > 1,
                           staging_buffers=plan.staging_buffers,  # the planner's (planner.staging_ring)
                           copier_threads=plan.copier_threads)  # the link's, whose staged rate the plan priced


class LifecycleError(RuntimeError):
    """A lifecycle call out of order (finish before prepare, prepare twice)."""


class UseState(enum.Enum):
    OUT = "out"  # between uses: layers released, non-layer weights parked if the gate said so
    IN_USE = "in_use"  # prepared for its stage


@dataclass(frozen=True)
class RequestFigures:
    """What one request measured."""

    peak_device_bytes: int  # distinct device storages of all components' parameters, at peak
    bytes_moved: int  # host->device bytes: streamed and resident layers, restores


class _Component:
    """One component under its strategy; subclasses implement the strategy."""

    def __init__(self, name: str, module: nn.Module, plan: ComponentPlan, device: torch.device,
                 tables: HostTables):
        self.name, self.module, self.plan, self.device, self.tables = name, module, plan, device, tables
        self.state = UseState.OUT
        self.parking: Parking | None = None
        self.streamer = None
        self.meter: DeviceWeightMeter | None = None
        self.table_decisions: tuple = ()  # every declared table's verdict, hosted or not (the report's)

    def prepare(self) -> None:
        """Bring the component in for its stage."""

    def finish(self) -> None:
        """Release it after its stage."""

    def gate(self) -> None:
        """After the whole stage finished: park non-layer weights if the gate says it pays."""

    def bytes_moved(self) -> int:
        return self.parking.bytes_restored if self.parking is not None else 0

    def reset_counters(self) -> None:
        if self.parking is not None:
            self.parking.bytes_restored = 0

    def hooked_modules(self) -> list[nn.Module]:
        return [self.module]

    def remove(self) -> None:
        if self.meter is not None:  # stop counting in CPU headroom now, not when the GC frees it
            self.meter.close()
        self.tables.remove()


class _Resident(_Component):
    def __init__(self, *args):
        super().__init__(*args)
        with self.tables.detached():
            move_unsharded(self.module, self.device)
            self.meter = DeviceWeightMeter(self.module, self.device, track_headroom=True)


class _ModelOffload(_Component):
    def __init__(self, *args):
        super().__init__(*args)
        with self.tables.detached():
            self.meter = DeviceWeightMeter(self.module, self.device, track_headroom=True)
            self.parking = Parking(self.name, self.module, self.device, meter=self.meter)
        # Buffers are small and read every call: they live on the device for good.
        for buf_owner in self.module.modules():
            for key, buf in own_buffers(buf_owner).items():
                if buf is not None:
                    own_buffers(buf_owner)[key] = buf.to(self.device)
        if all(p.device.type == "cpu" for p in self.module.parameters()):
            self.parking.park_from_host()
        else:
            self.parking.park()

    def prepare(self) -> None:
        self.parking.restore()

    def finish(self) -> None:
        self.parking.park()  # the strategy itself says out after the stage: no gate


class _Layerwise(_Component):
    def __init__(self, *args, park_fraction: float, parked: bool, host_layers=None):
        super().__init__(*args)

        with self.tables.detached():
            self.streamer = apply_layer_streaming(self.module, self.device, streaming_config(self.plan),
                                                  host_layers=host_layers)
            self.meter = self.streamer.meter
            if self.plan.park:
                layer_params = [p for layer in self.streamer.layers for p in layer.params]
                # The next use's largest allocation is a ring slot: the gate counts only headroom
                # slot-sized allocations can get.
                slot = self.streamer.ring.regions.nbytes if self.streamer.ring.n_slots else 0
                self.parking = Parking(self.name, self.module, self.device, exclude=layer_params,
                                       fraction=park_fraction, meter=self.meter, min_block=slot)
        if self.parking is not None and parked:
            # Start as the planner predicts the gate leaves it between requests, so the first
            # request moves what every later one does.
            self.parking.park()

    def prepare(self) -> None:
        if self.parking is not None:
            self.parking.restore()
        self.streamer.prepare_for_use()

    def finish(self) -> None:
        self.streamer.finish_use()

    def gate(self) -> None:
        if self.parking is not None:
            self.parking.park_if_it_pays()

    def bytes_moved(self) -> int:
        return super().bytes_moved() + self.streamer.bytes_copied

    def reset_counters(self) -> None:
        super().reset_counters()
        self.streamer.reset_counters()

    def hooked_modules(self) -> list[nn.Module]:
        return [self.module, *(layer.module for layer in self.streamer.layers)]

    def remove(self) -> None:
        if self.parking is not None and self.parking.parked:
            self.parking.restore()
        self.streamer.remove()
        super().remove()


class PipelineResidency:
    """Every component of a pipeline under its plan, and the lifecycle of its stages."""

    def __init__(self, components: dict[str, _Component], plan: PipelinePlan, device: torch.device,
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
            built = _build(components, plan, device, tables, shared_hosts)
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

    def _pick(self, names: Sequence[str]) -> list[_Component]:
        unknown = [n for n in names if n not in self.components]
        if unknown:
            raise KeyError(f"unknown components {unknown}; this pipeline has {sorted(self.components)}")
        return [self.components[n] for n in names]


def _build(components: Mapping[str, nn.Module], plan: PipelinePlan, device: torch.device, tables: HostTablesConfig,
           shared_hosts: Mapping[str, dict]) -> dict[str, _Component]:
    """Each component under its strategy (streamed ones hosted from ``shared_hosts`` where given)."""
    built: dict[str, _Component] = {}
    for cplan in plan.components:
        module = components[cplan.name]
        decisions = select_host_tables(module, tables)  # reported either way: every table's verdict and why
        host = HostTables(module, decisions if cplan.host_tables else ())
        host.install(device)
        args = (cplan.name, module, cplan, device, host)
        if cplan.strategy is Strategy.RESIDENT:
            built[cplan.name] = _Resident(*args)
        elif cplan.strategy is Strategy.MODEL_OFFLOAD:
            built[cplan.name] = _ModelOffload(*args)
        else:
            built[cplan.name] = _Layerwise(*args, park_fraction=plan.park_fraction,
                                           parked=bool(cplan.prediction and cplan.prediction.parked),
                                           host_layers=shared_hosts.get(cplan.name))
        built[cplan.name].table_decisions = decisions
        logger.info("residency %s: %s", cplan.name, cplan.explain())
    return built
