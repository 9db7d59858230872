"""Tensor-parallel (DTensor) parameters as the engine sees them: which are sharded, what a rank holds.

Pure torch; runs wherever the engine or the planner runs (a stage replica's rank worker, the
planner CLI on ``meta``). A model loaded with a tensor-parallel plan (transformers'
``DistributedConfig(tp_size=N, tp_plan=...)``) holds its sharded weights as ``DTensor``
parameters. Two traps, measured with torch 2.13:

- ``param.data = t`` on a DTensor parameter silently corrupts it: its *global* shape becomes
  ``t``'s shape (an 8x4 table sharded over 2 ranks, rebound to its 4x4 local shard, reports
  4x4 thereafter and the next collective computes garbage). So the engine never streams, parks
  or hosts a sharded parameter: it stays on the rank's device where the loader put it, and
  counts as a kept (non-layer) weight.
- ``numel()`` and ``shape`` of a DTensor are global: a rank holding half of umT5-XXL's 3.91 GiB
  token table would be counted at 3.91 GiB. Every byte count here is the rank's *local* bytes.
"""
from __future__ import annotations

import contextlib
import logging
import sys
from typing import Iterable, Iterator

import torch
from torch import nn

from compat.torch import own_parameters

logger = logging.getLogger(__name__)


def _dtensor_type() -> type | None:
    """DTensor, once something has imported it; None before (then no tensor can be one).

    Importing torch.distributed.tensor costs 0.8 s of CPU (its op registrations pull in sympy and
    the symbolic-shapes machinery), most of what planning a real model from its skeleton took the
    first time: a test for "is this a DTensor" must not pay it when no DTensor exists. Importing any
    of its submodules (DTensor lives in ``torch.distributed.tensor._api``) imports the package first.
    """
    return getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)


def is_sharded(tensor: object) -> bool:
    """Whether ``tensor`` is a DTensor (a tensor-parallel parameter or its ``.data``)."""
    dtensor = _dtensor_type()
    return dtensor is not None and isinstance(tensor, dtensor)


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The part of ``tensor`` this rank holds: a DTensor's local shard, any other tensor itself."""
    return tensor.to_local() if is_sharded(tensor) else tensor


def local_numel(tensor: torch.Tensor) -> int:
    return local_tensor(tensor).numel()


def local_nbytes(tensor: torch.Tensor) -> int:
    """Bytes this rank holds of ``tensor`` (a DTensor's local shard, not its global size)."""
    local = local_tensor(tensor)
    return local.numel() * local.element_size()


def sharded_parameters(module: nn.Module) -> tuple[tuple[str, nn.Parameter], ...]:
    """``module``'s DTensor parameters, each once, by name."""
    return tuple((name, p) for name, p in module.named_parameters() if is_sharded(p))


class ShardedParameterError(RuntimeError):
    """An operation that would rebind ``.data`` of (or move off its device) a tensor-parallel parameter."""


def refuse_sharded(params: Iterable[torch.Tensor], what: str) -> None:
    """Raise before ``what`` touches a DTensor: rebinding its ``.data`` would corrupt its global shape."""
    for p in params:
        if is_sharded(p):
            raise ShardedParameterError(
                f"{what}: a tensor-parallel (DTensor) parameter of global shape {tuple(p.shape)} cannot be "
                "rebound; sharded parameters stay on their rank's device")


@contextlib.contextmanager
def sharded_detached(model: nn.Module) -> Iterator[int]:
    """Take the DTensor parameters out of ``model`` so a ``.to(device)`` inside leaves them where they are.

    Yields how many were detached. A DTensor stays on the device its mesh put it on: moving it
    would need a redistribution on every rank, and ``.to`` may swap or rebind it.
    """
    held: list[tuple[nn.Module, str, nn.Parameter]] = []
    for module in model.modules():
        for name, p in own_parameters(module).items():
            if p is not None and is_sharded(p):
                held.append((module, name, p))
    for module, name, _ in held:
        own_parameters(module)[name] = None
    try:
        yield len(held)
    finally:
        for module, name, p in held:
            own_parameters(module)[name] = p


def move_unsharded(model: nn.Module, device: torch.device) -> nn.Module:
    """``model.to(device)`` for every parameter and buffer but the DTensors, which must already be there.

    A rank's shards are put on its device by the loader (``device_map`` of its rank); one found
    elsewhere is refused rather than moved (a move would need every rank's redistribution).
    """
    device = torch.device(device)
    for name, p in sharded_parameters(model):
        where = local_tensor(p).device
        if where.type != device.type or (device.index is not None and where.index not in (None, device.index)):
            raise ShardedParameterError(
                f"tensor-parallel parameter {name} is on {where}, the engine runs on {device}: load the shards "
                "onto the rank's device (device_map) before offloading")
    with sharded_detached(model) as n:
        model.to(device)
    if n:
        logger.info("%s: %d tensor-parallel parameters kept where their mesh put them (%d B local)",
                    type(model).__name__, n, sum(local_nbytes(p) for _, p in sharded_parameters(model)))
    return model


__all__ = [
    "ShardedParameterError", "is_sharded", "local_nbytes", "local_numel", "local_tensor", "move_unsharded", "refuse_sharded",
    "sharded_detached", "sharded_parameters",
]
