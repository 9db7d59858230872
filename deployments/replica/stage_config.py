"""What one stage replica is configured with: :class:`StageConfig` (built by ``deployments.app.build_app``).

Plain data, read by the stage replica's worker and by the ingress when it builds the app.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from deployments.models.families import FamilyTraits
from deployments.models.lora_rows import ServedLora
from deployments.replica.batching import BatchingConfig
from deployments.replica.warmup import WarmupShape
from deployments.wire.spec import PipelineStage
from offload_core.compile import CompileConfig
from offload_core.host.budget_cap import HostBudgetSpec
from offload_core.planner.search import PerformanceMode
from offload_core.quant import WeightFormat
from offload_core.tables import HostTablesConfig

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class StageConfig:
    """What one stage replica needs; built by ``deployments.app.build_app``."""

    app_name: str
    facts: FamilyTraits
    stage: PipelineStage
    mode: PerformanceMode | None  # None: the fleet profile's for the GPU the replica got
    # Forward passes per request of each of the stage's components (the planner weighs bytes by it).
    uses_per_request: tuple[tuple[str, int], ...]
    dtype: str
    # How long a call waits for its device working set before answering 503 (Retry-After).
    device_timeout_s: float
    # The stage's per-replica host_memory_budget (bytes or a fraction of spendable RAM); None: unset.
    host_budget: HostBudgetSpec | None = None
    # The Denoiser's step-level batching (None for the other stages: they run once per request).
    batching: BatchingConfig | None = None
    # Streamed layers hosted from the node weight store (one copy per node) rather than privately.
    share_host_weights: bool = True
    # The default request (limits.default_size / default_frames): the warm-up times the layers and sizes
    # the working set there (deployments/replica/warmup.py); None: the default Limits'.
    warmup_shape: WarmupShape | None = None
    # How the stage's streamed layers are hosted and copied (StageArgs.weights).
    weights: WeightFormat = WeightFormat.NATIVE
    # The Denoiser's step cache threshold for requests that do not set one (0: off).
    cache_threshold: float = 0.0
    # Ranks of one replica (tensor parallelism, deployments/replica/tensor_parallel/group.py); 1: today's single process.
    tp_size: int = 1
    # Which token tables the stage's replicas consider hosting (offload_core.tables); a sharded one never is.
    host_tables: HostTablesConfig = HostTablesConfig()
    # The Denoiser's LoRA adapters (AppArgs.lora_adapters), loaded and checked at start, and the device
    # bytes their A/B matrices may hold (least recently used ones evicted beyond it).
    loras: tuple[ServedLora, ...] = ()
    lora_device_budget: int = 0
    # torch.compile of the stage's repeated blocks (StageArgs.compile): None: eager.
    compile: CompileConfig | None = None
    # The niceness asked for the replica's process (AppArgs.replica_niceness); None: Ray's, unchecked.
    niceness: int | None = None
    # The decoder only: its VAE decodes outputs larger than the tile tile by tile (StageArgs.vae_tiling resolved
    # for the family), at vae_tile_px (None: the VAE's own tile). deployments/models/vae_tiling.py.
    vae_tiling: bool = False
    vae_tile_px: int | None = None
