"""Host layers whose flat buffers are views of a node weight store (``offload_core.shared_store.store``).

The store's copy is shared and read-only; what is per process is the tier: a PINNED layer's
pages are registered for DMA by this process (``cudaHostRegister`` with the read-only flag, on
page-aligned extents), a PAGEABLE one is not. A device that refuses read-only registration gets
the layer PAGEABLE (staged copies), said once in the log, never silently.
"""
from __future__ import annotations

import logging
from typing import Mapping

import torch

from offload_core.host.pinned import HostBuffer, free_host_buffer, lock_host_tensor
from offload_core.host.tier import HostingTier
from offload_core.layout import LayerLayout, LayoutError
from offload_core.shared_store.store import WeightStore
from offload_core.streaming.host_layer import HostLayer

logger = logging.getLogger(__name__)

# cudaHostRegisterReadOnly: the pages are only ever read by the device (CUDA >= 11.1, where
# cudaDevAttrHostRegisterReadOnlySupported is 1). A read-only mapping cannot be registered without it.
_REGISTER_READ_ONLY = 0x08


class SharedHostLayer(HostLayer):
    """A layer hosted by a shared store: its bytes belong to the store, not to this process."""

    shared = True


def register_read_only(data: torch.Tensor, device: torch.device) -> HostBuffer:
    """Page-lock a read-only shared buffer for this process; pageable (with the refusal) if the device refuses.

    Through ``host.pinned``: the driver API, so a refusal leaves no CUDA error state; unlocking
    waits for the device.
    """
    return lock_host_tensor(data, device, flags=_REGISTER_READ_ONLY)


def shared_host_layers(store: WeightStore, layouts: Mapping[str, LayerLayout], tiers: Mapping[str, HostingTier],
                       device: torch.device) -> dict[str, HostLayer]:
    """One :class:`SharedHostLayer` per layer of ``layouts``, in its tier, over ``store``'s mapping."""
    hosts, refused = {}, []
    for key, layout in layouts.items():
        tier = tiers[key]
        if tier is HostingTier.MAPPED:
            raise LayoutError(f"layer {key} is planned MAPPED; a store-hosted layer is PINNED or PAGEABLE")
        flat = store.buffers(key)
        if dict(layout.host_flat_bytes) != {d: t.numel() for d, t in flat.items()}:
            raise LayoutError(f"layer {key}: store extents {sorted(map(str, flat))} do not match its layout")
        lock = tier is HostingTier.PINNED  # a no-op without a page locker (CPU): planned pinned, pageable
        buffers = {d: register_read_only(t, device) if lock else HostBuffer(t, t.numel(), page_locked=False)
                   for d, t in flat.items()}
        if any(b.refusal is not None for b in buffers.values()):
            for buffer in buffers.values():  # all or nothing per layer, so free() unregisters what it must
                free_host_buffer(buffer)
            buffers = {d: HostBuffer(t, t.numel(), page_locked=False) for d, t in flat.items()}
            tier = HostingTier.PAGEABLE
            refused.append(key)
        hosts[key] = SharedHostLayer(layout, tier, buffers, ())
    if refused:
        logger.info("store %s: the device refused read-only pinning of %d layers (%s...): they stream PAGEABLE "
                    "through staging", store.key.digest, len(refused), refused[0])
    return hosts
