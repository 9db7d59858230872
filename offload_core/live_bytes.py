"""Bytes of the tensors a call creates and still holds: current and peak, on any device, meta included.

A torch dispatch mode: every tensor an op returns is charged for its storage the first time that storage is
seen, and the charge is dropped when the last tensor seen on it dies. Storages that existed before the call
(weights, inputs, slots) are never charged, nor is an op's output that shares an input's storage (an in-place
copy into a slot, a view of a weight), so what is counted is what the call added. A meter counts the storages
of one device type: the CPU's, told apart by address as a replica measures its calls there
(offload_core/residency/activation_meter.py), or meta's, told apart by identity since a meta storage has no
address (data_ptr 0), as the planner measures real-size calls (offload_core/planner/meta_activations.py).
Keyed by identity on the CPU too, the tiny Wan Denoiser's stand-in peak came out 1.19x the real chain's (by
address: within 2 %): what the replicas' calibration was validated with is kept there.

Runs in whichever process measures: a stage replica's calibration, the planner.
"""
from __future__ import annotations

import weakref
from typing import Iterable

import torch

from compat.torch import TorchDispatchMode, is_wrapper_subclass, storage_key, tree_leaves


def _storage(tensor: torch.Tensor):
    # A wrapper subclass (a DTensor, the AsyncCollectiveTensor an all-reduce returns) has no storage
    # of its own: what it holds is its inner tensor's (a DTensor's local shard).
    while is_wrapper_subclass(tensor):
        inner, _ = tensor.__tensor_flatten__()
        tensor = getattr(tensor, inner[0])
    return tensor.untyped_storage()


class LiveTensorBytes(TorchDispatchMode):
    """Current and peak bytes of storages created by ops inside the mode and still referenced."""

    def __init__(self, existing: Iterable[torch.Tensor] = (), device_type: str = "cpu"):
        super().__init__()
        self.device_type = device_type
        self._existing = {self._key(_storage(t)) for t in existing}
        self._live: dict[int, int] = {}  # storage identity -> bytes charged
        self._refs: dict[int, int] = {}  # storage identity -> tensors seen on it, still alive
        self.current = self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        mine = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor) and self._counts(t)]
        inputs = {self._key(_storage(t)) for t in mine}
        for value in tree_leaves(out):
            if isinstance(value, torch.Tensor) and self._counts(value):
                self._charge(value, inputs)
        return out

    def _counts(self, tensor: torch.Tensor) -> bool:
        return _storage(tensor).device.type == self.device_type

    def _key(self, storage) -> int:
        return storage_key(storage) if self.device_type == "meta" else storage.data_ptr()

    def _charge(self, tensor: torch.Tensor, inputs: set[int]) -> None:
        storage = _storage(tensor)
        key, nbytes = self._key(storage), storage.nbytes()
        if key == 0 or nbytes == 0 or key in self._existing or (key in inputs and key not in self._live):
            return
        if key not in self._live:
            self._live[key] = nbytes
            self.current += nbytes
            self.peak = max(self.peak, self.current)
        self._refs[key] = self._refs.get(key, 0) + 1
        weakref.finalize(tensor, self._drop, key)

    def _drop(self, key: int) -> None:
        self._refs[key] -= 1
        if self._refs[key] == 0:
            del self._refs[key]
            self.current -= self._live.pop(key)
