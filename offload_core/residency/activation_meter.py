"""Measure a call's activation memory: the peak bytes of tensors it allocates beyond the weights.

On CUDA the caching allocator counts: ``max_memory_allocated`` over the call minus what was
allocated before it. A CPU has no such counter, so :class:`LiveTensorBytes` (a torch dispatch
mode) counts it: every tensor an op returns is charged for its storage the first time that
storage is seen, and the charge is dropped when the last tensor seen on it dies. Storages that
existed before the call (weights, inputs, slots) are never charged, nor is an op's output that
shares an input's storage (an in-place copy into a slot, a view of a weight), so what is counted
is what the call added: the figure a device lease for the call's activations must cover.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Callable, Iterable

import torch

from compat.torch import TorchDispatchMode, is_wrapper_subclass, tree_leaves


def _storage(tensor: torch.Tensor):
    # A wrapper subclass (a DTensor, the AsyncCollectiveTensor an all-reduce returns) has no storage
    # of its own: what it holds is its inner tensor's (a DTensor's local shard).
    while is_wrapper_subclass(tensor):
        inner, _ = tensor.__tensor_flatten__()
        tensor = getattr(tensor, inner[0])
    return tensor.untyped_storage()


class LiveTensorBytes(TorchDispatchMode):
    """Current and peak bytes of storages created by ops inside the mode and still referenced."""

    def __init__(self, existing: Iterable[torch.Tensor] = ()):
        super().__init__()
        self._existing = {_storage(t).data_ptr() for t in existing}
        self._live: dict[int, int] = {}  # storage data_ptr -> bytes charged
        self._refs: dict[int, int] = {}  # storage data_ptr -> tensors seen on it, still alive
        self.current = self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        inputs = {_storage(t).data_ptr() for t in tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor) and t.device.type != "meta"}
        for value in tree_leaves(out):
            if isinstance(value, torch.Tensor) and value.device.type != "meta":
                self._charge(value, inputs)
        return out

    def _charge(self, tensor: torch.Tensor, inputs: set[int]) -> None:
        storage = _storage(tensor)
        key, nbytes = storage.data_ptr(), storage.nbytes()
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


@dataclass(frozen=True)
class ActivationMeasurement:
    peak_bytes: int  # the most bytes the call held at once beyond what existed before it
    how: str  # "cuda max_memory_allocated" or "cpu live tensor storages"


def measure_activations(call: Callable[[], object], device: torch.device | str,
                        existing: Iterable[torch.Tensor] = ()) -> tuple[object, ActivationMeasurement]:
    """Run ``call`` and measure its activation peak on ``device``.

    ``existing``: tensors whose storages are not the call's (weights: every parameter of the
    components it runs); on CUDA, whatever was allocated before the call is excluded anyway.
    """
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        result = call()
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) - before
        return result, ActivationMeasurement(max(0, peak), "cuda max_memory_allocated")
    meter = LiveTensorBytes(existing)
    with meter:
        result = call()
    return result, ActivationMeasurement(meter.peak, "cpu live tensor storages")

