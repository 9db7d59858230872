"""The component units: one pipeline component kept under its plan's strategy, built from the plan.

Each strategy is a unit with the same five calls (``prepare`` before its stage, ``finish`` after,
``gate`` once the whole stage finished, ``bytes_moved``/``reset_counters`` per request, ``remove``):
RESIDENT (moved once), MODEL_OFFLOAD (starts parked on the host, in for its stage, out after)
or LAYERWISE (the streaming engine, with optional parking of non-layer weights and host-gathered
token tables). :class:`~offload_core.residency.lifecycle.PipelineResidency` drives them; the units
know nothing of stages or requests. Runs in the process that holds the pipeline (a stage replica).
"""
from __future__ import annotations

import enum
import logging
from typing import Mapping

import torch
from torch import nn

from compat.torch import own_buffers
from offload_core.planner.pipeline_plan import ComponentPlan, PipelinePlan
from offload_core.planner.strategy import Strategy
from offload_core.residency.host_tables import HostTables
from offload_core.residency.parking import Parking
from offload_core.streaming.engine import ResidentPlacement, StreamingConfig, apply_layer_streaming
from offload_core.streaming.meter import DeviceWeightMeter
from offload_core.tables import HostTablesConfig, select_host_tables
from offload_core.tensor_parallel.sharded import move_unsharded

logger = logging.getLogger(__name__)


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


class UseState(enum.Enum):
    OUT = "out"  # between uses: layers released, non-layer weights parked if the gate said so
    IN_USE = "in_use"  # prepared for its stage


class ComponentUnit:
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


class ResidentUnit(ComponentUnit):
    def __init__(self, *args):
        super().__init__(*args)
        with self.tables.detached():
            move_unsharded(self.module, self.device)
            self.meter = DeviceWeightMeter(self.module, self.device, track_headroom=True)


class ModelOffloadUnit(ComponentUnit):
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


class LayerwiseUnit(ComponentUnit):
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


def build_units(components: Mapping[str, nn.Module], plan: PipelinePlan, device: torch.device,
                tables: HostTablesConfig, shared_hosts: Mapping[str, dict]) -> dict[str, ComponentUnit]:
    """Each component under its strategy (streamed ones hosted from ``shared_hosts`` where given)."""
    built: dict[str, ComponentUnit] = {}
    for cplan in plan.components:
        module = components[cplan.name]
        decisions = select_host_tables(module, tables)  # reported either way: every table's verdict and why
        host = HostTables(module, decisions if cplan.host_tables else ())
        host.install(device)
        args = (cplan.name, module, cplan, device, host)
        if cplan.strategy is Strategy.RESIDENT:
            built[cplan.name] = ResidentUnit(*args)
        elif cplan.strategy is Strategy.MODEL_OFFLOAD:
            built[cplan.name] = ModelOffloadUnit(*args)
        else:
            built[cplan.name] = LayerwiseUnit(*args, park_fraction=plan.park_fraction,
                                              parked=bool(cplan.prediction and cplan.prediction.parked),
                                              host_layers=shared_hosts.get(cplan.name))
        built[cplan.name].table_decisions = decisions
        logger.info("residency %s: %s", cplan.name, cplan.explain())
    return built
