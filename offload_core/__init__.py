"""offload_core: stream, host and plan a diffusion model's weights on a device too small for it.

The public API. Everything a user needs for a model the project does not ship:

- stream a model's layers:      ``apply_layer_streaming(model, device, StreamingConfig(...))``
- choose where each layer waits: ``HostingTier`` per layer in ``StreamingConfig.hosting``
- host and copy 8-bit weights:  ``StreamingConfig(weights=WeightFormat.FP8)``; ``fake_quantize_`` makes
  the plain reference with the same loss
- keep huge token tables on the host: ``apply_host_tables``
- LoRA adapters per request, unmerged: ``load_lora`` -> ``apply_lora(model, device, budget).load(adapter)``,
  then ``with lora_set.rows([(name, scale) | None per batch row]): model(...)``
- run a pipeline's components per plan: ``PipelineResidency``
- plan without a GPU:           ``profile_component`` -> ``PipelineFacts`` -> ``plan_pipeline``
- see where the weights are:    ``residency_report``
- share a GPU with other processes: ``get_device(d).set_neighbours(outstanding_bytes)``; headroom
  (``get_device(d).headroom(min_block)``) then leaves their leased bytes alone

Subpackages, one concept each: ``streaming`` (the engine), ``host`` (host memory), ``residency``
(component lifecycle and report), ``planner`` (facts, cost model, plan; no runtime state), ``lora``
(adapters per request, unmerged, on resident or streamed Linears).
"""
# Lazy: ``offload_core.X`` imports X's module on first use (PEP 562). Each process that imports any
# offload_core module (the node ledger actor, the residency board) runs this file; eager imports here
# pulled torch into all of them, 1.0 s of CPU each on a quiet 2-core machine (3 s under load).
import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from offload_core.host.budget import InProcessLedger, Lease, MemoryBudget, Refusal
    from offload_core.host.hosting import HostingError, HostingPlan, HostingPolicy, plan_hosting
    from offload_core.host.pinned import PinError
    from offload_core.host.tier import HostingTier
    from offload_core.layout import LayoutError
    from offload_core.lora import LoadedAdapter, LoraAdapter, LoraError, LoraSet, apply_lora, check_fits, load_lora
    from offload_core.planner.facts import ComponentProfile, LinkFacts, PipelineFacts, profile_component
    from offload_core.planner.pipeline_plan import ComponentOverride, ComponentPlan, PerformanceMode, PipelinePlan
    from offload_core.planner.search import plan_pipeline
    from offload_core.planner.strategy import Strategy
    from offload_core.quant import WeightFormat, fake_quantize_
    from offload_core.residency.host_tables import apply_host_tables
    from offload_core.residency.lifecycle import LifecycleError, PipelineResidency
    from offload_core.residency.report import ResidencyReport, residency_report
    from offload_core.streaming.device import DeviceCapacity, get_device
    from offload_core.streaming.engine import (
        AlreadyStreamedError,
        ConcurrentForwardError,
        LayerStreamer,
        ResidentPlacement,
        StreamingConfig,
        apply_layer_streaming,
    )
    from offload_core.streaming.headroom import Headroom, HeadroomTimeout
    from offload_core.tables import HostTablesConfig

_HOME = {
    "InProcessLedger": "offload_core.host.budget",
    "Lease": "offload_core.host.budget",
    "MemoryBudget": "offload_core.host.budget",
    "Refusal": "offload_core.host.budget",
    "HostingError": "offload_core.host.hosting",
    "HostingPlan": "offload_core.host.hosting",
    "HostingPolicy": "offload_core.host.hosting",
    "plan_hosting": "offload_core.host.hosting",
    "PinError": "offload_core.host.pinned",
    "HostingTier": "offload_core.host.tier",
    "LayoutError": "offload_core.layout",
    "LoadedAdapter": "offload_core.lora",
    "LoraAdapter": "offload_core.lora",
    "LoraError": "offload_core.lora",
    "LoraSet": "offload_core.lora",
    "apply_lora": "offload_core.lora",
    "check_fits": "offload_core.lora",
    "load_lora": "offload_core.lora",
    "ComponentProfile": "offload_core.planner.facts",
    "LinkFacts": "offload_core.planner.facts",
    "PipelineFacts": "offload_core.planner.facts",
    "profile_component": "offload_core.planner.facts",
    "ComponentOverride": "offload_core.planner.pipeline_plan",
    "ComponentPlan": "offload_core.planner.pipeline_plan",
    "PerformanceMode": "offload_core.planner.pipeline_plan",
    "PipelinePlan": "offload_core.planner.pipeline_plan",
    "plan_pipeline": "offload_core.planner.search",
    "Strategy": "offload_core.planner.strategy",
    "WeightFormat": "offload_core.quant",
    "fake_quantize_": "offload_core.quant",
    "apply_host_tables": "offload_core.residency.host_tables",
    "LifecycleError": "offload_core.residency.lifecycle",
    "PipelineResidency": "offload_core.residency.lifecycle",
    "ResidencyReport": "offload_core.residency.report",
    "residency_report": "offload_core.residency.report",
    "DeviceCapacity": "offload_core.streaming.device",
    "get_device": "offload_core.streaming.device",
    "AlreadyStreamedError": "offload_core.streaming.engine",
    "ConcurrentForwardError": "offload_core.streaming.engine",
    "LayerStreamer": "offload_core.streaming.engine",
    "ResidentPlacement": "offload_core.streaming.engine",
    "StreamingConfig": "offload_core.streaming.engine",
    "apply_layer_streaming": "offload_core.streaming.engine",
    "Headroom": "offload_core.streaming.headroom",
    "HeadroomTimeout": "offload_core.streaming.headroom",
    "HostTablesConfig": "offload_core.tables",
}

__all__ = [
    # streaming
    "apply_layer_streaming", "StreamingConfig", "ResidentPlacement", "LayerStreamer", "DeviceCapacity",
    "get_device", "Headroom", "HeadroomTimeout", "WeightFormat", "fake_quantize_",
    # host memory
    "HostingTier", "HostingPlan", "HostingPolicy", "plan_hosting", "MemoryBudget", "InProcessLedger",
    "Lease", "Refusal",
    # residency
    "Strategy", "PipelineResidency", "apply_host_tables", "HostTablesConfig", "ResidencyReport",
    "residency_report",
    # planning
    "profile_component", "ComponentProfile", "LinkFacts", "PipelineFacts", "plan_pipeline",
    "PerformanceMode", "ComponentOverride", "ComponentPlan", "PipelinePlan",
    # LoRA adapters per request
    "load_lora", "check_fits", "apply_lora", "LoraSet", "LoraAdapter", "LoadedAdapter",
    # exceptions a user may catch
    "LayoutError", "AlreadyStreamedError", "ConcurrentForwardError", "LifecycleError", "PinError",
    "HostingError", "LoraError",
]


def __getattr__(name: str):
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module 'offload_core' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value  # once: later lookups are plain attribute reads
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
