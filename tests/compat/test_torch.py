"""torch's private API as compat/torch.py relies on it: each test fails, naming the seam, when an upgrade moved it."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from compat import torch as seam
from compat.checked import REGISTRY
from offload_core.tensor_parallel.plans import planning_world


def use(name: str):
    return REGISTRY[f"compat.torch.{name}"]


def test_module_registries_are_the_live_dicts_torch_reads():
    lin = nn.Linear(2, 2)
    assert set(seam.own_parameters(lin)) == {"weight", "bias"}, use("own_parameters").mismatch("lost a parameter")
    seam.own_parameters(lin)["bias"] = None  # written through: torch sees it
    assert lin.bias is None and [n for n, _ in lin.named_parameters()] == ["weight"], \
        use("own_parameters").mismatch("is not the dict nn.Module reads")
    norm = nn.BatchNorm1d(2)
    moved = torch.ones(2)
    seam.own_buffers(norm)["running_mean"] = moved
    assert norm.running_mean is moved, use("own_buffers").mismatch("is not the dict nn.Module reads")


def test_child_registry_keeps_ties_and_none():
    root = nn.Sequential(nn.Linear(2, 2))
    seam.own_children(root)["tied"] = root[0]
    seam.own_children(root)["empty"] = None
    assert list(seam.own_children(root)) == ["0", "tied", "empty"], use("own_children").mismatch("dropped an entry")
    assert root.tied is root[0] and len(list(root.children())) == 1, use("own_children").mismatch("is not live")


def test_non_persistent_buffers_leave_the_state_dict():
    module = nn.Module()
    module.register_buffer("kept", torch.zeros(1))
    module.register_buffer("scratch", torch.zeros(1), persistent=False)
    assert seam.non_persistent_buffers(module) == {"scratch"}, use("non_persistent_buffers").mismatch("moved")
    seam.non_persistent_buffers(module).add("kept")
    assert "kept" not in module.state_dict(), use("non_persistent_buffers").mismatch("is not the set state_dict reads")


def test_view_base_is_the_viewed_tensor():
    owner = torch.zeros(8, dtype=torch.uint8)
    view = owner[4:8].view(2, 2)[1]  # a view of a view: its base is the allocation, not the middle view
    assert seam.view_base(view) is owner and seam.view_base(owner) is None, use("view_base").mismatch("changed")


def test_storage_key_tells_storages_apart_on_meta_where_addresses_do_not():
    one, other = torch.empty(8, device="meta"), torch.empty(8, device="meta")
    assert one.untyped_storage().data_ptr() == other.untyped_storage().data_ptr() == 0
    key = seam.storage_key
    assert key(one.untyped_storage()) != key(other.untyped_storage()), use("storage_key").mismatch("not an identity")
    assert key(one[2:].view(2, 3).untyped_storage()) == key(one.untyped_storage()), use("storage_key").mismatch(
        "differs between views of one storage")


def test_fake_backend_and_dtensor_shard_replacement():
    from torch.distributed.tensor import DTensor, Shard

    with planning_world(2) as mesh:  # register_fake_backend + init_process_group("fake")
        whole = torch.arange(8.0)
        dtensor = DTensor.from_local(whole[:4], mesh, [Shard(0)], run_check=False)
        assert seam.is_wrapper_subclass(dtensor) and not seam.is_wrapper_subclass(whole), \
            use("is_wrapper_subclass").mismatch("no longer recognizes a DTensor")
        copy = dtensor.to_local().clone()
        seam.replace_local_tensor(dtensor, copy)
        assert dtensor.to_local().data_ptr() == copy.data_ptr() and dtensor.shape == (8,), \
            use("replace_local_tensor").mismatch("did not replace the shard")
        try:
            seam.replace_local_tensor(dtensor, torch.zeros(3))
        except ValueError as exc:
            assert "must match" in str(exc)
        else:
            raise AssertionError("a shard of another shape was accepted")


def test_dispatch_mode_sees_every_op():
    seen = []

    class Ops(seam.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    with Ops():
        torch.ones(2).add(1).mul(2)
    assert {"add", "mul"} <= set(seen), use("TorchDispatchMode").mismatch(f"saw only {seen}")


def test_pytree_leaves_and_map_keep_the_nesting():
    tree = ((1, [2, 3]), {"a": 4, "b": (5,)})
    assert seam.tree_leaves(tree) == [1, 2, 3, 4, 5], use("tree_leaves").mismatch("changed the order")
    assert seam.tree_map(lambda x: x * 10, tree) == ((10, [20, 30]), {"a": 40, "b": (50,)}), \
        use("tree_map").mismatch("changed the nesting")


def test_dynamo_counts_graphs_marks_dims_dynamic_and_names_refused_traces(monkeypatch, tmp_path):
    def double(x):
        return x * 2

    compiled = torch.compile(double, backend="eager", fullgraph=True)
    before = seam.compiled_graph_count()
    a, b = torch.ones(2, 4), torch.ones(2, 6)
    seam.mark_dynamic(a, 1, 2, 8)
    seam.mark_dynamic(b, 1, 2, 8)
    compiled(a), compiled(b)
    assert seam.compiled_graph_count() - before == 1, use("mark_dynamic").mismatch("no longer makes one graph")
    assert seam.raise_recompile_limit(1) >= 8 and seam.raise_recompile_limit(99) == 99, \
        use("raise_recompile_limit").mismatch("changed")

    def refused(x):
        return x + 1 if torch.is_inference_mode_enabled() else x

    with pytest.raises(Exception) as caught:
        torch.compile(refused, backend="eager", fullgraph=True)(torch.ones(1))
    assert seam.is_unsupported_trace(caught.value), use("is_unsupported_trace").mismatch("is not what dynamo raises")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "unchanged")
    seam.use_inductor_cache(str(tmp_path))
    import os

    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path)


def _declared(name: str) -> str:
    """``name``'s declaration in torch's own stub of ``torch._C`` (shipped with CPU and CUDA builds)."""
    import pathlib

    stub = (pathlib.Path(torch.__file__).parent / "_C" / "__init__.pyi").read_text()
    return next((line.strip() for line in stub.splitlines() if line.startswith(f"def {name}(")), "")


def test_the_cuda_stream_calls_are_declared_as_the_engine_calls_them():
    mismatch = use("cuda_stream_calls").mismatch
    assert _declared("_cuda_getDevice") == "def _cuda_getDevice() -> _int: ...", mismatch("changed")
    assert _declared("_cuda_getCurrentStream") == "def _cuda_getCurrentStream(device: _int) -> tuple: ...", \
        mismatch("changed")
    assert _declared("_cuda_setStream") == ("def _cuda_setStream(stream_id: _int, device_index: _int, "
                                            "device_type: _int) -> None: ..."), mismatch("changed")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the calls exist in a CUDA build only")
def test_cuda_the_stream_calls_read_and_set_what_torch_cuda_does():
    get_device, current, set_stream = seam.cuda_stream_calls()
    index = torch.cuda.current_device()
    assert get_device() == index
    before, side = torch.cuda.current_stream(), torch.cuda.Stream()
    assert current(index) == (before.stream_id, before.device_index, before.device_type)
    set_stream(side.stream_id, side.device_index, side.device_type)
    try:
        assert torch.cuda.current_stream() == side, use("cuda_stream_calls").mismatch("does not set the stream")
    finally:
        set_stream(before.stream_id, before.device_index, before.device_type)
    assert torch.cuda.current_stream() == before
