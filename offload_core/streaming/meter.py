"""An independent meter of weight bytes materialized on a device.

It knows nothing of the engine's bookkeeping: at each observed hook it walks the model's
parameters and sums the distinct device storages that non-empty parameters point at (released
parameters point at zero-element placeholders and count nothing). Tests and benchmarks compare
its peak with the engine's prediction (non-layer + resident + slots), which must match exactly.
"""
from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from offload_core.streaming.device import get_device, normalize_device


class DeviceWeightMeter:
    """Current and peak bytes of ``model``'s parameter storages on ``device``."""

    def __init__(self, model: nn.Module, device: torch.device | str, *, track_headroom: bool = False):
        self._device = normalize_device(device)
        # The Parameter objects are stable (the engine rebinds .data, never the objects), so the
        # list is taken once: walking it is ~1 us per parameter, a module walk several times that.
        self._params = tuple(model.parameters())
        self._peak = 0
        self._handles: list = []
        if track_headroom:
            get_device(self._device).track(self)

    def measure(self) -> int:
        """Bytes of distinct device storages the parameters point at now."""
        storages: dict[int, int] = {}
        for param in self._params:
            if param.numel() == 0 or param.device != self._device:
                continue
            storage = param.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
        return sum(storages.values())

    def sample(self) -> int:
        """Measure now and raise the peak if needed; returns the current bytes."""
        current = self.measure()
        self._peak = max(self._peak, current)
        return current

    @property
    def current_bytes(self) -> int:
        return self.sample()

    @property
    def peak_bytes(self) -> int:
        return self._peak

    def reset_peak(self) -> None:
        """Start a new peak from what is materialized now."""
        self._peak = self.measure()

    def attach(self, modules: Iterable[nn.Module]) -> None:
        """Sample before and after each forward of ``modules``.

        Hooks run in registration order, so a meter attached after the engine's hooks sees each
        layer after the engine materialized it (pre) and after it released it (post).
        """
        for module in modules:
            self._handles.append(module.register_forward_pre_hook(self._observe))
            self._handles.append(module.register_forward_hook(self._observe, always_call=True))

    def _observe(self, *_hook_args) -> None:
        # Returns None on purpose: a hook's return value would replace the inputs or the output.
        self.sample()

    def close(self) -> None:
        """Stop sampling and stop counting in the device's headroom (the streamer is removed)."""
        self.detach()
        get_device(self._device).untrack(self)

    def detach(self) -> None:
        """Stop sampling at hooks (benchmarks time forwards without the ~1 us/parameter walks)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
