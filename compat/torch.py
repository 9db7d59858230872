"""torch's private API, one function per use: module registries, views' bases, DTensor shards,
dispatch modes, pytrees and the fake process group. Runs in whichever process calls it.

Public instead of private, where torch has it: a store for the fake process group is the public
``torch.distributed.HashStore`` (not ``fake_pg.FakeStore``); a DTensor's shard is read with
``DTensor.to_local()`` where a read is all that is needed (``offload_core.tensor_parallel.sharded``).
"""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn
from torch.utils import _python_dispatch, _pytree

from compat.checked import PrivateUse, record, relies_on

CHECKED = ("2.13.0", "2.13.0")

# The registries nn.Module keeps its own tensors and children in. Its public views hide what the
# engine needs: named_parameters(recurse=False) skips None entries, named_children() skips None and
# repeated (tied) children, and none of them can be written to in place without re-registering.
REGISTRY_WHY = "nn.Module's public views skip None entries and ties and cannot swap a tensor in place"


@relies_on("torch", "nn.Module._parameters", CHECKED, REGISTRY_WHY)
def own_parameters(module: nn.Module) -> dict[str, nn.Parameter | None]:
    """``module``'s own parameters, the live dict (None entries and ties kept; writes take effect)."""
    return module._parameters


@relies_on("torch", "nn.Module._buffers", CHECKED, REGISTRY_WHY)
def own_buffers(module: nn.Module) -> dict[str, torch.Tensor | None]:
    """``module``'s own buffers, the live dict (None entries kept; writes take effect)."""
    return module._buffers


@relies_on("torch", "nn.Module._modules", CHECKED, REGISTRY_WHY)
def own_children(module: nn.Module) -> dict[str, nn.Module | None]:
    """``module``'s direct children, the live dict (None and tied children kept; writes take effect)."""
    return module._modules


@relies_on("torch", "nn.Module._non_persistent_buffers_set", CHECKED,
           "register_buffer(persistent=False) is the only public door, and it cannot be read back")
def non_persistent_buffers(module: nn.Module) -> set[str]:
    """Names of ``module``'s own buffers left out of its state dict, the live set."""
    return module._non_persistent_buffers_set


@relies_on("torch", "Tensor._base", CHECKED, "torch has no public 'the tensor this view was made from'")
def view_base(tensor: torch.Tensor) -> torch.Tensor | None:
    """The tensor ``tensor`` is a view of (None when it owns its storage)."""
    return tensor._base


@relies_on("torch", "UntypedStorage._cdata", CHECKED,
           "a meta storage has no address (data_ptr() is 0): its C++ object is its only identity")
def storage_key(storage: torch.UntypedStorage) -> int:
    """An identity of ``storage`` shared by every tensor on it, and no other live storage's, on any device."""
    return storage._cdata


@relies_on("torch", "DTensor._local_tensor", CHECKED,
           "DTensor.to_local() reads the shard but nothing public replaces it under the same DTensor")
def replace_local_tensor(dtensor: torch.Tensor, local: torch.Tensor) -> None:
    """Make ``local`` the shard ``dtensor`` holds on this rank (same shape, dtype and device)."""
    held = dtensor._local_tensor
    if local.shape != held.shape or local.dtype != held.dtype or local.device != held.device:
        raise ValueError(f"a replacement shard must match the held one: {tuple(local.shape)} {local.dtype} "
                         f"{local.device} vs {tuple(held.shape)} {held.dtype} {held.device}")
    dtensor._local_tensor = local


@relies_on("torch", "torch.testing._internal.distributed.fake_pg", CHECKED,
           "the 'fake' backend is registered only by importing torch's test helper")
def register_fake_backend() -> None:
    """Make ``init_process_group("fake", ...)`` available: a process group that runs no collective."""
    import torch.testing._internal.distributed.fake_pg  # noqa: F401  (registers the backend on import)


# A dispatch mode sees every aten op a forward runs; torch keeps its base class in a private module.
TorchDispatchMode = _python_dispatch.TorchDispatchMode
record(f"{__name__}.TorchDispatchMode", PrivateUse(
    "torch", "torch.utils._python_dispatch.TorchDispatchMode", CHECKED, "no public home in torch"))


@relies_on("torch", "torch.utils._python_dispatch.is_traceable_wrapper_subclass", CHECKED, "no public home in torch")
def is_wrapper_subclass(tensor: object) -> bool:
    """True for a tensor subclass that wraps inner tensors (a DTensor, an AsyncCollectiveTensor)."""
    return _python_dispatch.is_traceable_wrapper_subclass(tensor)


@relies_on("torch", "torch.utils._pytree.tree_flatten", CHECKED, "torch's pytree has no public module")
def tree_leaves(tree: Any) -> list[Any]:
    """Every leaf of nested tuples, lists and dicts, in order."""
    return _pytree.tree_flatten(tree)[0]


@relies_on("torch", "torch.utils._pytree.tree_map", CHECKED, "torch's pytree has no public module")
def tree_map(fn: Callable[[Any], Any], tree: Any) -> Any:
    """``tree`` with every leaf replaced by ``fn(leaf)``, same nesting."""
    return _pytree.tree_map(fn, tree)


# -- torch.compile's dynamo and inductor (offload_core.compile) --------------------------------------
COMPILE_WHY = "torch.compile has no public counter of compiled graphs, dynamic-dim marker or cache-size knob"


@relies_on("torch", "torch._dynamo.utils.counters", CHECKED, COMPILE_WHY)
def compiled_graph_count() -> int:
    """Graphs dynamo has compiled in this process (first compiles and recompiles alike)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


@relies_on("torch", "torch._dynamo.mark_dynamic", CHECKED, COMPILE_WHY)
def mark_dynamic(tensor: torch.Tensor, dim: int, low: int, high: int) -> None:
    """Compile ``tensor``'s ``dim`` as a symbol in ``[low, high]`` (not one graph per size)."""
    import torch._dynamo

    torch._dynamo.mark_dynamic(tensor, dim, min=low, max=high)


@relies_on("torch", "torch._dynamo.config.recompile_limit", CHECKED, COMPILE_WHY)
def raise_recompile_limit(limit: int) -> int:
    """At least ``limit`` compiled entries per code object before dynamo falls back to eager; returns
    the limit now in force."""
    import torch._dynamo

    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, int(limit))
    return torch._dynamo.config.recompile_limit


@relies_on("torch", "torch._dynamo.exc.Unsupported", CHECKED, COMPILE_WHY)
def is_unsupported_trace(error: BaseException) -> bool:
    """True when ``error`` is dynamo refusing to trace something (a full graph is not possible)."""
    from torch._dynamo.exc import Unsupported

    return isinstance(error, Unsupported)


@relies_on("torch", "torch._inductor.config.fx_graph_cache", CHECKED, COMPILE_WHY)
def use_inductor_cache(directory: str) -> None:
    """Inductor's on-disk caches (FX graph cache, compiled kernels) under ``directory``: a restarted
    process finds the graphs it compiled before."""
    import os

    import torch._inductor.config

    os.environ["TORCHINDUCTOR_CACHE_DIR"] = directory  # read by inductor at each cache lookup
    torch._inductor.config.fx_graph_cache = True


STREAM_WHY = ("torch.cuda.current_stream builds a Stream object per read and torch.cuda.stream a StreamContext "
              "per switch; the engine's hooks do both for every layer (on the H200 the hooks alone took 60.7 us "
              "per layer against 15-22 us on CPU)")


@relies_on("torch", "torch._C._cuda_getDevice / _cuda_getCurrentStream / _cuda_setStream", CHECKED, STREAM_WHY)
def cuda_stream_calls() -> tuple[Callable[[], int], Callable[[int], tuple], Callable[[int, int, int], None]]:
    """torch's C calls behind ``torch.cuda``: the current device; a device's current stream as a
    ``(stream_id, device_index, device_type)`` tuple; setting a stream current (its device made
    current too, as ``torch.cuda.set_stream`` does). A CUDA build of torch only."""
    c = torch._C
    return c._cuda_getDevice, c._cuda_getCurrentStream, c._cuda_setStream
