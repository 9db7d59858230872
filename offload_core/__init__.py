"""offload_core: stream, host and plan a diffusion model's weights on a device too small for it.

The public API. Everything a user needs for a model the project does not ship:

- stream a model's layers:      ``apply_layer_streaming(model, device, StreamingConfig(...))``
- choose where each layer waits: ``HostingTier`` per layer in ``StreamingConfig.hosting``
- host and copy 8-bit weights:  ``StreamingConfig(weights=WeightFormat.FP8)``; ``fake_quantize_`` makes
  the plain reference with the same loss
- keep huge token tables on the host: ``apply_host_tables``
- run a pipeline's components per plan: ``PipelineResidency``
- plan without a GPU:           ``profile_component`` -> ``PipelineFacts`` -> ``plan_pipeline``
- see where the weights are:    ``residency_report``
- share a GPU with other processes: ``get_device(d).set_neighbours(outstanding_bytes)``; headroom
  (``get_device(d).headroom(min_block)``) then leaves their leased bytes alone

Subpackages, one concept each: ``streaming`` (the engine), ``host`` (host memory), ``residency``
(component lifecycle and report), ``planner`` (facts, cost model, plan; no runtime state).
"""
from offload_core.host.budget import InProcessLedger, Lease, MemoryBudget, Refusal
from offload_core.host.hosting import HostingError, HostingPlan, HostingPolicy, plan_hosting
from offload_core.host.pinned import PinError
from offload_core.host.tier import HostingTier
from offload_core.layout import LayoutError
from offload_core.planner.facts import (
                                           ComponentProfile,
                                           LinkFacts,
                                           PipelineFacts,
                                           profile_component,
)
from offload_core.planner.pipeline_plan import (
                                           ComponentOverride,
                                           ComponentPlan,
                                           PerformanceMode,
                                           PipelinePlan,
)
from offload_core.planner.search import plan_pipeline
from offload_core.planner.strategy import Strategy
from offload_core.quant import WeightFormat, fake_quantize_
from offload_core.residency.host_tables import apply_host_tables
from offload_core.residency.lifecycle import LifecycleError, PipelineResidency
from offload_core.residency.report import ResidencyReport, residency_report
from offload_core.streaming.device import DeviceFacts, get_device
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

__all__ = [
    # streaming
    "apply_layer_streaming", "StreamingConfig", "ResidentPlacement", "LayerStreamer", "DeviceFacts",
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
    # exceptions a user may catch
    "LayoutError", "AlreadyStreamedError", "ConcurrentForwardError", "LifecycleError", "PinError",
    "HostingError",
]
