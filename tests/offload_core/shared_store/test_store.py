"""The node weight store: written once, mapped read-only, checked on attach, swept when orphaned."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from torch import nn

from offload_core.host.budget import InProcessLedger
from offload_core.layout import layer_parameters, plan_layer_layout
from offload_core.shared_store.registry import InProcessStoreRegistry
from offload_core.shared_store.store import (
    StoreMismatch,
    StoreRole,
    WeightStore,
    folder_identity,
    key_for,
    sweep_orphans,
)


def blocks(seed: int, width: int = 64, n: int = 3) -> nn.ModuleList:
    torch.manual_seed(seed)
    return nn.ModuleList([nn.Linear(width, width) for _ in range(n)])


def layers_of(modules: nn.ModuleList):
    out = []
    for i, layer in enumerate(modules):
        named = layer_parameters(layer)
        out.append((plan_layer_layout(f"blocks.{i}", [(n, p.data) for n, p in named]), [p.data for _, p in named]))
    return out


def make(tmp_path, seed=0, identity="model-a"):
    layers = layers_of(blocks(seed))
    key, layout = key_for(identity, "transformer", [lay for lay, _ in layers])
    return layers, key, layout, tmp_path / key.file_name


def test_a_store_is_written_once_and_a_later_replica_maps_the_same_bytes(tmp_path):
    layers, key, layout, path = make(tmp_path)
    first = WeightStore.create(path, key, layout, layers)
    second = WeightStore.attach(path, key, layout)
    assert (first.role, second.role) == (StoreRole.CREATE, StoreRole.ATTACH)
    for lay, tensors in layers:
        (flat,) = second.buffers(lay.key).values()
        weight = flat[:tensors[0].numel() * 4].view(torch.float32).view_as(tensors[0])
        assert torch.equal(weight, tensors[0])
        assert flat.data_ptr() % 4096 == 0, "each extent starts on its own page, for per-process registration"
    assert not any(p.name.count(".partial-") for p in tmp_path.iterdir()), "the partial write was renamed into place"
    first.close()
    second.close()


def test_a_replica_cannot_write_through_its_read_only_mapping(tmp_path):
    layers, key, layout, path = make(tmp_path)
    WeightStore.create(path, key, layout, layers).close()
    script = ("import sys, torch; from offload_core.shared_store.store import *; from tests.offload_core.host.test_store "
              "import make; import pathlib; _, k, lay, p = make(pathlib.Path(sys.argv[1])); "
              "s = WeightStore.attach(p, k, lay); s.buffers('blocks.0')[torch.float32][0] = 7; print('wrote')")
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "wrote" not in done.stdout, "a write into another replica's weights must fault"


def test_a_store_whose_sampled_pages_changed_is_refused_naming_the_difference(tmp_path):
    layers, key, layout, path = make(tmp_path)
    WeightStore.create(path, key, layout, layers).close()
    offset = layout.sampled_offsets()[1]
    with open(path, "r+b") as f:
        f.seek(offset + 8)
        f.write(b"\xff\xfe")
    with pytest.raises(StoreMismatch, match="sampled pages differ"):
        WeightStore.attach(path, key, layout)


def test_a_store_of_another_layout_under_this_name_is_refused(tmp_path):
    layers, key, layout, path = make(tmp_path)
    other_layers = layers_of(blocks(0, width=64, n=3))
    # Same sizes, other parameter order: a layout that would bind weights to the wrong tensors.
    swapped = [(plan_layer_layout(lay.key, list(reversed([(m.name, t) for m, t in zip(lay.tensors, tensors)]))),
                list(reversed(tensors))) for lay, tensors in other_layers]
    other_key, other_layout = key_for("model-a", "transformer", [lay for lay, _ in swapped])
    WeightStore.create(tmp_path / "other", other_key, other_layout, swapped).close()
    (tmp_path / "other").rename(path)
    with pytest.raises(StoreMismatch, match="refusing"):
        WeightStore.attach(path, key, layout)


def test_a_folder_identity_changes_when_a_checkpoint_file_changes(tmp_path):
    (tmp_path / "diffusion_pytorch_model.safetensors").write_bytes(b"a" * 10)
    before = folder_identity(tmp_path)
    assert folder_identity(tmp_path) == before
    (tmp_path / "diffusion_pytorch_model.safetensors").write_bytes(b"b" * 11)
    assert folder_identity(tmp_path) != before


def test_a_store_no_live_process_holds_is_swept_and_a_held_one_is_kept(tmp_path):
    layers, key, layout, path = make(tmp_path)
    held = WeightStore.create(path, key, layout, layers)
    orphan_layers, orphan_key, orphan_layout, orphan = make(tmp_path, seed=1, identity="model-b")
    WeightStore.create(orphan, orphan_key, orphan_layout, orphan_layers).close()  # its process "crashed"
    assert sweep_orphans(tmp_path) == (orphan.name,)
    assert path.exists() and not orphan.exists()
    held.close()
    assert sweep_orphans(tmp_path) == (path.name,)


def test_the_registry_leases_a_shared_copy_once_and_the_last_detach_frees_it(tmp_path):
    layers, key, layout, path = make(tmp_path)
    node = InProcessLedger(1 << 30)
    registry = InProcessStoreRegistry(node)
    first = registry.acquire(key, layout.total_bytes, str(path), "r1")
    assert first.role is StoreRole.CREATE
    store = WeightStore.create(path, key, layout, layers)
    registry.ready(key, "r1")
    second = registry.acquire(key, layout.total_bytes, str(path), "r2")
    assert second.role is StoreRole.ATTACH and second.attached == 2
    assert node.leased() == layout.total_bytes, "two replicas, one copy, one lease"
    assert registry.attachment(key).share_bytes == layout.total_bytes // 2
    store.close()
    registry.release(key, "r1")
    assert node.leased() == layout.total_bytes and path.exists(), "r2 still maps it"
    registry.release(key, "r2")
    assert node.leased() == 0 and not path.exists() and registry.attachment(key) is None


def test_a_replica_whose_budget_could_not_hold_the_whole_copy_is_not_admitted(tmp_path):
    _, key, layout, path = make(tmp_path)
    registry = InProcessStoreRegistry(InProcessLedger(1 << 30))
    refused = registry.acquire(key, layout.total_bytes, str(path), "small", budget_bytes=layout.total_bytes - 1)
    assert not refused and "could not hold the whole" in refused.reason



def test_two_replicas_of_one_owner_name_in_one_process_stay_attached_until_both_detach(tmp_path):
    layers, key, layout, path = make(tmp_path)
    node = InProcessLedger(1 << 30)
    registry = InProcessStoreRegistry(node)
    registry.acquire(key, layout.total_bytes, str(path), "local-encode")
    store = WeightStore.create(path, key, layout, layers)
    registry.ready(key, "local-encode")
    assert registry.acquire(key, layout.total_bytes, str(path), "local-encode").attached == 2
    registry.release(key, "local-encode")
    assert path.exists() and node.leased() == layout.total_bytes, "the other replica still uses it"
    registry.release(key, "local-encode")
    assert not path.exists() and node.leased() == 0
    store.close()
