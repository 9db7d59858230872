"""A replica's streamed components hosted from node weight stores instead of private copies.

:class:`SharedWeights` is what a replica hands ``PipelineResidency.apply``: for each streamed
component it asks the registry for the store of (model folder identity, component, dtypes,
layout). The first replica writes the store from its loaded weights; every later one maps it and
copies nothing: its layers' parameters are released unread, so it reads no checkpoint bytes for
them. A replica the registry does not admit (its budget could not hold the whole copy, or the
node pool is full) hosts privately as before, said in the log.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Mapping, Sequence

import torch
from torch import nn

from offload_core.host.budget import Refusal
from offload_core.host.tier import HostingTier
from offload_core.layout import LayerLayout, declared_layer_groups, layer_parameters
from offload_core.order import declared_layers
from offload_core.quant import WeightFormat, layer_layout
from offload_core.shared_store.layer import shared_host_layers
from offload_core.shared_store.registry import StoreAttachment, StoreRegistry
from offload_core.shared_store.store import (
    StoreKey,
    StoreLayout,
    StoreRole,
    WeightStore,
    key_for,
    remove_if_unused,
    store_dir,
)
from offload_core.streaming.host_layer import HostLayer

logger = logging.getLogger(__name__)


def _layers(module: nn.Module, groups: Sequence[str] | None,
            weights: WeightFormat = WeightFormat.NATIVE) -> list[tuple[LayerLayout, list[torch.Tensor]]]:
    """Every streamed layer's layout and tensors, in the engine's order and with the engine's layout
    (``weights``: FP8 layers are stored at their 8-bit size, quantized once by the store's writer)."""
    out = []
    for layer in declared_layers(module, groups or declared_layer_groups(module)):  # none without parameters
        named = layer_parameters(layer.module)
        out.append((layer_layout(layer.key, layer.module, weights), [p.data for _, p in named]))
    return out


class SharedWeights:
    """The stores one replica holds, by component; ``close()`` detaches from all of them."""

    def __init__(self, registry: StoreRegistry, identities: Mapping[str, str], owner: str,
                 directory: Path | None = None, budget_bytes: int | None = None):
        self.registry, self.owner, self.budget_bytes = registry, owner, budget_bytes
        self._identities = dict(identities)  # component -> folder_identity of its folder
        self._dir = directory or store_dir()
        self._stores: dict[str, WeightStore] = {}

    def covers(self, component: str) -> bool:
        return component in self._identities

    def key(self, component: str, module: nn.Module, groups: Sequence[str] | None,
            weights: WeightFormat = WeightFormat.NATIVE) -> tuple[StoreKey, StoreLayout]:
        return key_for(self._identities[component], component,
                       [layout for layout, _ in _layers(module, groups, weights)])

    def host_layers(self, component: str, module: nn.Module, groups: Sequence[str] | None,
                    tiers: Mapping[str, HostingTier], device: torch.device,
                    weights: WeightFormat = WeightFormat.NATIVE) -> dict[str, HostLayer] | None:
        """The component's layers hosted from its store (``weights``: the plan's format; an FP8 store
        holds the 8-bit values and scales, one copy for every replica), or None when not admitted."""
        layers = _layers(module, groups, weights)
        key, layout = key_for(self._identities[component], component, [lay for lay, _ in layers])
        path = self._dir / key.file_name
        ticket = self.registry.acquire(key, layout.total_bytes, str(path), self.owner, self.budget_bytes)
        if isinstance(ticket, Refusal):
            logger.info("%s: %s not hosted from a shared store (%d B): %s; it hosts its own copy", self.owner,
                        component, layout.total_bytes, ticket.reason)
            return None
        try:
            store = self._open(ticket.role, path, key, layout, layers)
            if store is None:
                self.registry.release(key, self.owner)
                return None
            hosts = shared_host_layers(store, {lay.key: lay for lay, _ in layers}, tiers, device)
        except BaseException:
            self.registry.release(key, self.owner)
            raise
        self._stores[component] = store
        logger.info("%s: %s hosted from store %s (%s, %d layers, %d B; %d replica(s) attached)", self.owner,
                    component, key.digest, ticket.role.value, len(hosts), layout.layer_bytes, ticket.attached)
        return hosts

    def _open(self, role: StoreRole, path: Path, key: StoreKey, layout: StoreLayout, layers) -> WeightStore | None:
        if role is StoreRole.CREATE:
            # A file the registry does not know: left by a crashed process (removed unless a live
            # process still holds it), or kept by a process outside this registry (mapped as is).
            if path.exists() and not remove_if_unused(path):
                logger.info("%s: store %s exists and a live process holds it: mapping it", self.owner, key.digest)
                store = WeightStore.attach(path, key, layout)
            else:
                try:
                    store = WeightStore.create(path, key, layout, layers)
                except OSError as exc:  # no room in /dev/shm (ENOSPC), or no such file system
                    logger.info("%s: store %s (%d B) could not be written in %s (%s); hosting privately",
                                self.owner, key.digest, layout.total_bytes, path.parent, exc)
                    return None
            self.registry.ready(key, self.owner)
            return store
        try:
            return WeightStore.attach(path, key, layout)
        except FileNotFoundError:
            logger.info("%s: store %s is registered but its file %s is gone; hosting privately", self.owner,
                        key.digest, path)
            return None

    def attachments(self) -> tuple[StoreAttachment, ...]:
        found = (self.registry.attachment(s.key) for s in self._stores.values())
        return tuple(a for a in found if a is not None)

    def roles(self) -> dict[str, StoreRole]:
        return {component: store.role for component, store in self._stores.items()}

    def close(self) -> None:
        """Detach from every store: the lock, then the registry (the last one out frees the copy)."""
        while self._stores:  # popped first: a failed release is not retried by a second close
            _, store = self._stores.popitem()
            store.close()
            self.registry.release(store.key, self.owner)
