"""How to stream one model: the validated configuration the engine and the planner's plans share.

Kept apart from the engine so a plan (``planner.pipeline_plan``) can describe an engine
configuration without the hooks, streams and buffers that come with the engine itself.
"""
from __future__ import annotations

import enum
import math
import types
from dataclasses import dataclass
from typing import Mapping

from offload_core.buffers import DEFAULT_STAGING_BUFFERS
from offload_core.fp8_widen import WidenMode
from offload_core.host.tier import HostingTier
from offload_core.order import Trace
from offload_core.quant import WeightFormat


class ResidentPlacement(enum.Enum):
    # The first layers in execution order: simplest, and the first layers are ready with no wait.
    LEADING = "leading"
    # Evenly spaced: each resident layer's compute gives the copy stream time to catch up on the
    # next streamed layer, which hides more transfer time when copies are slower than compute.
    STRIDED = "strided"


@dataclass(frozen=True)
class StreamingConfig:
    """How to stream one model. Validated on construction."""

    layer_groups: tuple[str, ...] | None = None  # None: the class's declared groups
    # The order layers run in (see offload_core.order), known before anything moves: a forward on
    # meta inputs to trace, or the layer keys in order (a plan's); None: the declared order.
    trace: Trace | None = None
    layer_order: tuple[str, ...] | None = None
    prefetch_depth: int = 1  # layers copied ahead of the running one (slots = depth + 1)
    resident: int | float = 0  # an int counts layers; a float in [0, 1] is a fraction of them
    resident_placement: ResidentPlacement = ResidentPlacement.LEADING
    keep_resident: bool = False  # keep resident layers (and slots) across finish_use
    hosting: Mapping[str, HostingTier] | None = None  # per layer key ("blocks.3"); default PAGEABLE
    # PAGEABLE and MAPPED layers reach the device through pinned staging buffers filled by a host
    # thread, so no copy blocks the thread that launches kernels. False: the driver's own blocking
    # copy (the negative control of bench/sim_overlap.py: a step costs copy + compute).
    staged_copies: bool = True
    staging_buffers: int = DEFAULT_STAGING_BUFFERS  # pinned buffers, each the largest staged layer
    # Threads each staging fill is split over (the copier's own, not torch's intra-op threads: Ray
    # runs a replica with OMP_NUM_THREADS=1, where one thread's memcpy is a tenth of a PCIe Gen5
    # link). None: the device's choice (CUDA: the fill probe's count, streaming.fill_threads; CPU: 1);
    # a plan sets the link probe's count, capped by the replicas sharing the node.
    copier_threads: int | None = None
    # How long allocating the ring's slots waits when only bytes neighbour processes leased (and
    # have not allocated yet) keep them from fitting; then HeadroomTimeout. 30 s: the service's
    # default device_timeout_s, the bound a call already waits for its lease.
    neighbour_wait_s: float = 30.0
    # FP8: Linear/Conv weights hosted and copied as e4m3 with per-channel scales, widened in the
    # slot on the device (offload_core.quant); lossy, opt-in. NATIVE: as loaded.
    weights: WeightFormat = WeightFormat.NATIVE
    # How FP8 layers widen on the device (offload_core.fp8_widen): EAGER, two passes; FUSED, one
    # compiled pass per group of same-shaped tensors (torch.compile; apply_block_compile turns it on).
    widen: WidenMode = WidenMode.EAGER
    # How long the launch thread waits for one staging fill before the call fails (FillTimeout,
    # a 503 in the service) and the copier is replaced; see staging.DEFAULT_FILL_TIMEOUT_S.
    fill_timeout_s: float = 30.0
    # The last layers' exits prefetch the next use's first layers (a denoiser's next step). False
    # for a component used once per request (an encoder, a VAE): its next use is the next request's,
    # after finish_use released the ring, so those copies were wasted (a window's bytes per request);
    # prepare_for_use fetches the first window then.
    wrap_uses: bool = True

    def __post_init__(self) -> None:
        if self.layer_groups is not None:
            if isinstance(self.layer_groups, str) or not all(isinstance(p, str) for p in self.layer_groups):
                raise TypeError(f"layer_groups must be a tuple of dotted paths, got {self.layer_groups!r}")
            if len(set(self.layer_groups)) != len(self.layer_groups) or not self.layer_groups:
                raise ValueError(f"layer_groups must be non-empty and distinct, got {self.layer_groups!r}")
            object.__setattr__(self, "layer_groups", tuple(self.layer_groups))
        if self.trace is not None and self.layer_order is not None:
            raise ValueError("give either a trace or a layer_order, not both: they could disagree")
        if self.trace is not None and not callable(self.trace):
            raise TypeError(f"trace must be a callable that runs one forward of the model, got {self.trace!r}")
        if self.layer_order is not None:
            if isinstance(self.layer_order, str) or not all(isinstance(k, str) for k in self.layer_order):
                raise TypeError(f"layer_order must be a tuple of layer keys, got {self.layer_order!r}")
            object.__setattr__(self, "layer_order", tuple(self.layer_order))
        if isinstance(self.prefetch_depth, bool) or not isinstance(self.prefetch_depth, int) or self.prefetch_depth < 1:
            raise ValueError(f"prefetch_depth must be an int >= 1, got {self.prefetch_depth!r}")
        if isinstance(self.resident, bool) or not isinstance(self.resident, (int, float)):
            raise TypeError(f"resident must be a layer count (int) or a fraction (float), got {self.resident!r}")
        if isinstance(self.resident, int) and self.resident < 0:
            raise ValueError(f"resident count must be >= 0, got {self.resident}")
        if isinstance(self.resident, float) and not 0.0 <= self.resident <= 1.0:
            raise ValueError(f"resident fraction must be in [0, 1], got {self.resident}")
        if not isinstance(self.resident_placement, ResidentPlacement):
            raise TypeError(f"resident_placement must be a ResidentPlacement, got {self.resident_placement!r}")
        if not isinstance(self.widen, WidenMode):
            raise TypeError(f"widen must be a WidenMode ({[m.value for m in WidenMode]}), got {self.widen!r}")
        if not isinstance(self.staged_copies, bool):
            raise TypeError(f"staged_copies must be a bool, got {self.staged_copies!r}")
        if isinstance(self.staging_buffers, bool) or not isinstance(self.staging_buffers, int) or self.staging_buffers < 1:
            raise ValueError(f"staging_buffers must be an int >= 1, got {self.staging_buffers!r}")
        if self.copier_threads is not None and (isinstance(self.copier_threads, bool)
                                                or not isinstance(self.copier_threads, int) or self.copier_threads < 1):
            raise ValueError(f"copier_threads must be None or an int >= 1, got {self.copier_threads!r}")
        if isinstance(self.neighbour_wait_s, bool) or not isinstance(self.neighbour_wait_s, (int, float)) \
                or self.neighbour_wait_s < 0:
            raise ValueError(f"neighbour_wait_s must be a number >= 0, got {self.neighbour_wait_s!r}")
        if not isinstance(self.weights, WeightFormat):
            raise TypeError(f"weights must be a WeightFormat, got {self.weights!r}")
        if isinstance(self.fill_timeout_s, bool) or not isinstance(self.fill_timeout_s, (int, float)) \
                or not self.fill_timeout_s > 0:
            raise ValueError(f"fill_timeout_s must be a number > 0, got {self.fill_timeout_s!r}")
        if self.hosting is not None:
            bad = {k: v for k, v in self.hosting.items() if not isinstance(v, HostingTier)}
            if bad:
                raise TypeError(f"hosting values must be HostingTier, got {bad!r}")
            object.__setattr__(self, "hosting", types.MappingProxyType(dict(self.hosting)))

    def resident_count(self, n_layers: int) -> int:
        """Resident layers out of ``n_layers``; a fraction rounds down (never over the device plan)."""
        if isinstance(self.resident, float):
            return math.floor(self.resident * n_layers)
        return min(self.resident, n_layers)


def choose_resident(n_layers: int, count: int, placement: ResidentPlacement) -> frozenset[int]:
    """Indices (in execution order) of the layers kept resident."""
    if count <= 0:
        return frozenset()
    if placement is ResidentPlacement.LEADING:
        return frozenset(range(count))
    return frozenset(math.floor(i * n_layers / count) for i in range(count))
