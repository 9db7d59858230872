"""The meter of weight bytes materialized on a device, kept incrementally: O(1) per change.

The engine tells the meter what it binds (a layer's parameters pointed at views of one device
allocation: a ring slot or a resident buffer) and releases; parking tells it what it moves. The
meter counts each distinct device storage once, as a walk over the parameters would, and raises
its peak at every increase, so it needs no hooks and never walks the model while it streams.

Why not walk: walking every parameter costs ~1 us each; at each layer hook of Wan2.1-14B's 40
blocks x 1,095 parameters that was 346 us per layer (13 ms per forward) for the meter alone.

:meth:`DeviceWeightMeter.walk` is that walk, kept as the audit: tests assert the incremental count
equals it after every hook of every tiny model, tier and mode. A layer the ring released with its
views kept (``StreamedLayer.release(keep_views=True)``: they still point into the window until the
use ends) counts nothing, in the count as in the walk.
"""
from __future__ import annotations

from typing import Hashable, Iterable

import torch
from torch import nn

from compat.torch import view_base
from offload_core.streaming.device import get_device, normalize_device
from offload_core.tensor_parallel.sharded import local_tensor


def walked_device_bytes(params: Iterable[torch.Tensor], device: torch.device) -> int:
    """Bytes of the distinct ``device`` storages that non-empty ``params`` point at (the audit).

    Released parameters point at zero-element placeholders and count nothing; views of one
    allocation (a slot carved per dtype) count the whole allocation once.
    """
    storages: dict[int, int] = {}
    for param in params:
        param = local_tensor(param)  # a DTensor counts the shard this rank holds
        if param.numel() == 0 or param.device != device:
            continue
        storage = param.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


class WeightTotal:
    """Current and peak bytes summed over several meters (a pipeline's components), kept as they change.

    The residency's sampler: no hook reads the meters; each change reaches the total at once, so
    its peak is exact (no transient between two hooks is missed) and costs O(1) per change.
    """

    def __init__(self):
        self.current = 0
        self.peak = 0

    def change(self, delta: int) -> None:
        self.current += delta
        if self.current > self.peak:
            self.peak = self.current

    def reset_peak(self) -> None:
        self.peak = self.current


class DeviceWeightMeter:
    """Current and peak bytes of ``model``'s parameter storages on ``device``, kept from events.

    ``rebase()`` takes what is on the device now (one walk, at setup); afterwards ``bind`` /
    ``release`` (the engine's layers) and ``moved`` (parked weights) keep the count.
    """

    def __init__(self, model: nn.Module, device: torch.device | str, *, track_headroom: bool = False):
        self._device = normalize_device(device)
        # The Parameter objects are stable (the engine rebinds .data, never the objects): taken once.
        self._params = tuple(model.parameters())
        self._unowned = 0  # bytes held by no bound owner: the walk at the last rebase, plus moves
        self._owners: dict[Hashable, int] = {}  # owner -> data_ptr of the storage it is bound to
        self._storages: dict[int, list[int]] = {}  # data_ptr -> [storage bytes, owners bound to it]
        # Owners released with their views kept -> those parameters (the walk passes over them).
        self._kept: dict[Hashable, tuple[torch.Tensor, ...]] = {}
        self._current = 0
        self._peak = 0
        self._totals: tuple[WeightTotal, ...] = ()
        self.rebase()
        if track_headroom:
            get_device(self._device).track(self)

    @property
    def device(self) -> torch.device:
        return self._device

    # -- events (O(1) each) ---------------------------------------------------------------------
    def bind(self, owner: Hashable, witness: torch.Tensor) -> None:
        """``owner``'s parameters now view the storage behind ``witness`` (any one of them, non-empty)."""
        storage = self.storage_of(witness)
        if storage is None:
            if owner in self._owners:
                self.release(owner)
            return
        self.bind_storage(owner, *storage)

    def storage_of(self, witness: torch.Tensor) -> tuple[int, int] | None:
        """The key and bytes :meth:`bind_storage` counts ``witness``'s storage by (None: not on this device)."""
        if witness.device != self._device:
            return None
        base = view_base(witness)
        if base is not None and view_base(base) is None and base.dtype is torch.uint8:
            # A view of one uint8 allocation (a slot, a resident buffer): the allocation's tensor is
            # the key and its length the bytes, with no storage object made (~2 us saved per bind).
            return id(base), base.numel()
        storage = witness.untyped_storage()
        return storage.data_ptr(), storage.nbytes()

    def bind_storage(self, owner: Hashable, key: int, nbytes: int) -> None:
        """``owner``'s parameters now view one allocation of ``nbytes``, known as ``key`` to every bind
        into it (the engine's window: the key of its tensor, given at each bind without a look at the views)."""
        if self._kept:
            self._kept.pop(owner, None)
        if owner in self._owners:
            self.release(owner)
        held = self._storages.get(key)
        if held is None:
            self._storages[key] = [nbytes, 1]
            self._change(nbytes)
        else:
            held[1] += 1
        self._owners[owner] = key

    def release(self, owner: Hashable, kept: tuple[torch.Tensor, ...] = ()) -> None:
        """``owner``'s parameters point at placeholders again (a no-op if it was not bound); or, with
        ``kept`` (those parameters), still at their views, which count nothing until :meth:`views_dropped`."""
        if kept:
            self._kept[owner] = kept
        key = self._owners.pop(owner, None)
        if key is None:
            return
        held = self._storages[key]
        held[1] -= 1
        if held[1] == 0:
            del self._storages[key]
            self._change(-held[0])

    def views_dropped(self, owner: Hashable) -> None:
        """``owner``'s kept views were pointed back at placeholders."""
        self._kept.pop(owner, None)

    def moved(self, nbytes: int) -> None:
        """``nbytes`` of unbound weights came onto (> 0) or left (< 0) the device (parking)."""
        self._unowned += nbytes
        self._change(nbytes)

    def rebase(self) -> None:
        """Count what is on the device now by one walk, and start the peak there (setup only).

        Bound owners are forgotten: call it while every layer is released.
        """
        self._owners.clear()
        self._storages.clear()
        walked = self.walk()
        for total in self._totals:
            total.change(walked - self._current)
        self._unowned = self._current = self._peak = walked

    def report_to(self, total: WeightTotal) -> None:
        """Keep ``total`` (a pipeline's sum over its components) informed of every change from now."""
        total.change(self._current)
        self._totals = (*self._totals, total)

    def _change(self, delta: int) -> None:
        self._current += delta
        if self._current > self._peak:
            self._peak = self._current
        for total in self._totals:
            total.change(delta)

    # -- readings -------------------------------------------------------------------------------
    @property
    def current_bytes(self) -> int:
        return self._current

    @property
    def peak_bytes(self) -> int:
        return self._peak

    def reset_peak(self) -> None:
        """Start a new peak from what is materialized now."""
        self._peak = self._current

    def walk(self) -> int:
        """The audit: what a walk over every parameter finds on the device now (~1 us per parameter),
        but for those of layers released with their views kept."""
        kept = {id(p) for params in self._kept.values() for p in params}
        return walked_device_bytes([p for p in self._params if id(p) not in kept], self._device)

    def close(self) -> None:
        """Stop counting in the device's headroom (the streamer is removed)."""
        get_device(self._device).untrack(self)
