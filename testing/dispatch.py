"""Counting the kernels a piece of torch code launches, on any device: the aten ops it dispatches.

A launch-thread cost model needs launches, and CI has no GPU to profile: every aten op that is not
a view or a metadata query would be a kernel launch (or a host-side copy) on CUDA, so counting
them on CPU counts what the launch thread pays for (``bench/widen_launches.py``, the FP8 widen
tests). Tests and benches only.
"""
from __future__ import annotations

import collections
from typing import Callable

from compat.torch import TorchDispatchMode

# Ops that launch nothing: views, reshapes and metadata (aten overload packet names).
VIEW_OPS = frozenset({
    "view", "_unsafe_view", "as_strided", "slice", "select", "reshape", "expand", "t", "transpose",
    "permute", "unsqueeze", "squeeze", "alias", "detach", "view_as", "unflatten", "flatten",
    "_reshape_alias", "lift_fresh", "empty", "empty_strided", "empty_like", "is_same_size", "sym_size",
    "sym_stride", "sym_numel", "sym_storage_offset", "dim", "size", "stride", "numel",
})


class KernelCounter(TorchDispatchMode):
    """Counts the aten ops dispatched inside it that would launch a kernel (not in ``VIEW_OPS``)."""

    def __init__(self):
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name not in VIEW_OPS:
            self.ops[name] += 1
        return func(*args, **(kwargs or {}))

    @property
    def launches(self) -> int:
        return sum(self.ops.values())


def count_launches(fn: Callable[[], object]) -> KernelCounter:
    """Run ``fn`` once and return what it launched."""
    with KernelCounter() as counter:
        fn()
    return counter
