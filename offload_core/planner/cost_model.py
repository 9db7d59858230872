"""The cost model: device bytes, bytes moved and time of a component plan, in the engine's terms.

Byte figures follow the engine exactly, so predictions equal what its meter and counters see:
- a streamed layer occupies its flat layout (one buffer per dtype, 512-byte aligned tensors);
  the ring is one window of min(depth + 1, streamed layers) x the largest streamed layer's bytes
  (per dtype), each copy placed after the last one in it; a resident layer has its own flat buffer;
- every layer copies its host buffers (PINNED from its own, PAGEABLE and MAPPED from the pinned
  staging buffer the host copier filled); a component with PAGEABLE or MAPPED layers holds
  ``buffers.staging_bytes`` of pinned staging buffers on the host; an FP8-hosted layer
  (``ComponentProfile.weights``) hosts and copies its 8-bit size (``layout.host_nbytes``) and the
  device holds two landing buffers more (``buffers.landing_bytes``);
- per request, ``prepare_for_use`` arms the resident layers and prefetches the layers the window
  holds from the first, each use copies every streamed layer once (each layer's exit issues the
  copies after it, wrapping into the next use); the count is the ring's own placement replayed
  (``buffers.window_copies``: ``U * streamed + W`` for equal layers, W = slots); ``finish_use``
  releases the wrapped ones.
Times: every copy to the device is from pinned memory on a side stream and overlaps compute; PAGEABLE
and MAPPED layers add a host memcpy into staging, on its own thread, that overlaps both. A use takes
the slowest of compute, the DMA (all streamed bytes at the pinned rate) and the memcpy (staged
bytes at the measured staged rate, ``LinkFacts.rate``; unmeasured, the pageable rate: the
driver's pageable copy is itself a memcpy into its own staging overlapped with a DMA), plus what
the plan's window makes it wait beyond that (``planner.window``: the ring replayed on the layers'
copy and compute times; none for equal layers, some for an uneven stack in too narrow a window).

Runs in whichever process plans: ``offload-serve plan`` and each stage replica (through ``cluster/replica/plan.py``).
"""
from __future__ import annotations

import functools
from typing import Sequence

from offload_core.buffers import RegionMap, landing_bytes, slot_count, staging_bytes, window_copies
from offload_core.host.tier import STAGED_TIERS, HostingTier
from offload_core.planner.facts import ComponentProfile, LayerProfile, LinkFacts
from offload_core.planner.pipeline_plan import ComponentPlan, ComponentPrediction
from offload_core.planner.strategy import Strategy
from offload_core.planner.window import window_wait_s


def copy_bytes(layer: LayerProfile, tier: HostingTier) -> int:
    """Bytes one host->device copy of ``layer`` moves from ``tier``: its host buffers, staged or not."""
    return layer.host_bytes


def component_staging_bytes(profile: ComponentProfile, plan: ComponentPlan) -> int:
    """Pinned host bytes of the component's staging buffers (0 unless a layer is PAGEABLE or MAPPED)."""
    if plan.strategy is not Strategy.LAYERWISE:
        return 0
    tiers = _tiers(plan)
    return staging_bytes((layer.layout.host_flat_bytes for layer in profile.layers
                          if tiers.get(layer.key) in STAGED_TIERS), plan.staging_buffers)


def slot_region_bytes(streamed: Sequence[LayerProfile]) -> int:
    """One ring slot, sized by the ring's own ``RegionMap.covering`` of the streamed layers."""
    return RegionMap.covering(layer.layout for layer in streamed).nbytes


def layer_copies(streamed: Sequence[LayerProfile], slots: int, uses: int) -> int:
    """Layer copies the ring makes in one request: its own placement replayed (``buffers.window_copies``)
    in a window of ``slots`` x the largest streamed layer's bytes; a component used once per request
    does not prefetch into a next use (``StreamingConfig.wrap_uses``, as the residency configures it)."""
    sizes = tuple(RegionMap.covering([layer.layout]).nbytes for layer in streamed)
    return _window_copies(sizes, slots * slot_region_bytes(streamed), uses, uses > 1)


@functools.lru_cache(maxsize=1024)
def _window_copies(sizes: tuple[int, ...], window: int, uses: int, wrap: bool) -> int:
    # A pure replay of uses x layers placements, and the plan search asks for the same few again and
    # again with other tiers or gates (509 replays for ~50 distinct rings, a third of a 3 s search)
    return window_copies(sizes, window, uses, wrap=wrap)


def n_slots(plan: ComponentPlan, n_streamed: int) -> int:
    return slot_count(plan.prefetch_depth, n_streamed)  # the ring's own rule


def non_layer_device_bytes(profile: ComponentProfile, plan: ComponentPlan) -> int:
    return profile.non_layer_bytes - (profile.table_bytes if plan.host_tables else 0)


def _split(profile: ComponentProfile, plan: ComponentPlan):
    r = min(plan.resident_layers, len(profile.layers))
    return profile.layers[:r], profile.layers[r:]


def device_bytes(profile: ComponentProfile, plan: ComponentPlan, parked: bool) -> tuple[int, int]:
    """(in use, idle) device weight bytes of the component under ``plan``; ``parked``: the gate parks it."""
    rest = non_layer_device_bytes(profile, plan)
    if plan.strategy is not Strategy.LAYERWISE:
        whole = rest + sum(layer.tensor_bytes for layer in profile.layers)
        return whole, (whole if plan.strategy is Strategy.RESIDENT else 0)
    resident, streamed = _split(profile, plan)
    slots = n_slots(plan, len(streamed)) * slot_region_bytes(streamed)
    landing = landing_bytes(layer.layout for layer in profile.layers)  # the engine's landing buffers
    in_use = rest + sum(layer.nbytes for layer in resident) + slots + landing
    return in_use, (0 if parked else rest)


def _tiers(plan: ComponentPlan) -> dict[str, HostingTier]:
    return dict(plan.hosting)


def _streamed_copy_bytes(streamed: Sequence[LayerProfile], tiers: dict[str, HostingTier], slots: int,
                        uses: int) -> dict[HostingTier, int]:
    """Bytes per tier the streamed layers copy in one request (see the module docstring)."""
    out = {tier: 0 for tier in HostingTier}
    if not streamed:
        return out
    count = layer_copies(streamed, slots, uses)
    full, rem = divmod(count, len(streamed))
    for i, layer in enumerate(streamed):
        tier = tiers[layer.key]
        out[tier] += (full + (1 if i < rem else 0)) * copy_bytes(layer, tier)
    return out


def predict(profile: ComponentProfile, plan: ComponentPlan, link: LinkFacts, parked: bool) -> ComponentPrediction:
    """Device bytes, bytes moved and time per request of one component under ``plan``.

    ``parked``: whether the parking gate parks its non-layer weights between uses (the planner
    predicts the gate; see ``planner._gates``).
    """
    parked = parked and plan.strategy is Strategy.LAYERWISE and plan.park
    in_use, idle = device_bytes(profile, plan, parked)
    uses = profile.uses_per_request
    compute = uses * profile.compute_s_per_use
    if plan.strategy is Strategy.RESIDENT:
        return ComponentPrediction(in_use, idle, 0, 0.0, compute, compute, False)
    if plan.strategy is Strategy.MODEL_OFFLOAD:
        # The host copy is pageable: one synchronous copy of the whole component per request.
        seconds = in_use / link.pageable_Bps
        return ComponentPrediction(in_use, idle, in_use, seconds, compute, compute + seconds, False)
    tiers = _tiers(plan)
    resident, streamed = _split(profile, plan)
    restore = non_layer_device_bytes(profile, plan) if parked else 0
    moved = {tier: 0 for tier in HostingTier}
    for layer in resident:
        moved[tiers[layer.key]] += copy_bytes(layer, tiers[layer.key])
    # Once per request, before the first use: parked weights back, residents armed.
    once_s = restore / link.pageable_Bps + sum(_seconds(n, t, link) for t, n in moved.items())
    for tier, nbytes in _streamed_copy_bytes(streamed, tiers, n_slots(plan, len(streamed)), uses).items():
        moved[tier] += nbytes
    per_use_dma = sum(copy_bytes(l, tiers[l.key]) for l in streamed) / link.pinned_Bps
    per_use_memcpy = sum(copy_bytes(l, tiers[l.key]) for l in streamed
                         if tiers[l.key] in STAGED_TIERS) / link.rate(HostingTier.PAGEABLE)
    compute_s = profile.compute_s_per_layer[len(resident):]
    wait = window_wait_s(streamed, tiers, link, compute_s, plan.prefetch_depth, profile.compute_s_rest)
    shallow = (wait if plan.prefetch_depth == 1 else
               window_wait_s(streamed, tiers, link, compute_s, 1, profile.compute_s_rest))
    bound = max(profile.compute_s_per_use, per_use_dma, per_use_memcpy)
    per_use = bound + wait
    transfer = restore / link.pageable_Bps + sum(_seconds(n, t, link) for t, n in moved.items())
    # A batch shares every copy: each request pays its share (1 unless the stage batches).
    share = profile.expected_batch
    window = n_slots(plan, len(streamed)) * slot_region_bytes(streamed) if streamed else 0
    sizes = [RegionMap.covering([layer.layout]).nbytes for layer in streamed]
    layers_held = (window // max(sizes), window // max(1, min(sizes))) if sizes else (0, 0)
    return ComponentPrediction(in_use, idle, round((restore + sum(moved.values())) / share), transfer / share,
                               compute, once_s + uses * per_use, parked,
                               component_staging_bytes(profile, plan),
                               sum(layer.host_bytes for layer in profile.layers),
                               sum(layer.nbytes for layer in profile.layers),
                               window_bytes=window, window_layers=layers_held, window_wait_s=wait,
                               window_shallow_wait_s=shallow, window_bound_s=bound)


def _seconds(nbytes: int, tier: HostingTier, link: LinkFacts) -> float:
    return nbytes / link.rate(tier)  # each tier at its own measured rate (staged for PAGEABLE/MAPPED)
