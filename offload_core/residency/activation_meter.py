"""Measure a call's activation memory: the peak bytes of tensors it allocates beyond the weights.

On CUDA the caching allocator counts: ``max_memory_allocated`` over the call minus what was
allocated before it. A CPU has no such counter, so :class:`offload_core.live_bytes.LiveTensorBytes` counts
the storages the call creates and still holds: the figure a device lease for the call's activations must cover.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable

import torch

from offload_core.live_bytes import LiveTensorBytes


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

