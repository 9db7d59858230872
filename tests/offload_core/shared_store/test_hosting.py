"""Replicas host a model's streamed layers from one node store: one copy, one lease, bitwise outputs."""
from __future__ import annotations

import torch

from offload_core.host.budget import InProcessLedger
from offload_core.host.tier import HostingTier
from offload_core.residency.lifecycle import PipelineResidency
from offload_core.shared_store.hosting import SharedWeights
from offload_core.shared_store.layer import SharedHostLayer
from offload_core.shared_store.registry import InProcessStoreRegistry
from offload_core.shared_store.store import StoreRole
from tests.offload_core.residency.test_lifecycle import Toy, toy_plan


def replica(name, registry, node, tmp_path, budget=None, spoil=False):
    models = {"a": Toy(0), "b": Toy(1)}
    if spoil:  # what a replica would compute if it read its own (here: wrong) checkpoint bytes
        for model in models.values():
            for p in model.blocks.parameters():
                p.data.fill_(float("nan"))
    shared = SharedWeights(registry, {"a": "toy-a", "b": "toy-b"}, name, tmp_path, budget_bytes=budget)
    residency = PipelineResidency.apply(models, toy_plan(1 << 30), "cpu", node, owner=name, shared=shared)
    return models, residency


def run(models, residency, x):
    out = {}
    for name, model in models.items():
        with residency.stage([name]):
            out[name] = model(x)
    return out


def test_a_second_replica_maps_the_store_reads_no_checkpoint_bytes_and_stays_bitwise(cpu_capacity, tmp_path):
    cpu_capacity(1 << 30)
    x = torch.randn(3, 16)
    expected = {n: m(x) for n, m in {"a": Toy(0), "b": Toy(1)}.items()}
    node = InProcessLedger(1 << 30)
    registry = InProcessStoreRegistry(node)
    first_models, first = replica("r1", registry, node, tmp_path)
    # The second replica's own layer weights are NaN: a bitwise-equal output proves it used the store.
    second_models, second = replica("r2", registry, node, tmp_path, spoil=True)
    assert first.shared.roles() == {"a": StoreRole.CREATE, "b": StoreRole.CREATE}
    assert second.shared.roles() == {"a": StoreRole.ATTACH, "b": StoreRole.ATTACH}
    for models, residency in ((first_models, first), (second_models, second)):
        got = run(models, residency, x)
        assert all(torch.equal(got[n], expected[n]) for n in expected)
        layers = residency.components["b"].streamer.layers
        assert all(isinstance(layer.host, SharedHostLayer) for layer in layers)
        assert {layer.tier for layer in layers} <= {HostingTier.PINNED, HostingTier.PAGEABLE}
    stores = sum(a.nbytes for a in first.shared.attachments())
    assert node.leased() == stores > 0, "two replicas, each store leased once"
    assert first.host_leased_bytes() == second.host_leased_bytes() == 0, "no private copies to pay for"
    assert [a.attached for a in second.shared.attachments()] == [2, 2]
    weights = second.report().component("b")
    host_layer_bytes = sum(t.numel() for layer in second.components["b"].streamer.layers
                           for t in layer.host_tensors())
    assert weights.host_shared_bytes == host_layer_bytes > 0, "the report shows store-hosted layers as shared"
    assert weights.host_pinned_bytes == weights.host_pageable_bytes == 0, "no private copy of them"
    first.remove()
    assert node.leased() == stores, "the second replica still maps both stores"
    assert all(torch.equal(v, expected[n]) for n, v in run(second_models, second, x).items())
    second.remove()
    assert node.leased() == 0 and not list(tmp_path.glob("offload-serve-*")), "the last one out frees the copy"


def test_a_replica_whose_budget_cannot_hold_the_copy_hosts_privately_and_stays_bitwise(cpu_capacity, tmp_path):
    cpu_capacity(1 << 30)
    x = torch.randn(3, 16)
    expected = {n: m(x) for n, m in {"a": Toy(0), "b": Toy(1)}.items()}
    node = InProcessLedger(1 << 30)
    models, residency = replica("small", InProcessStoreRegistry(node), node, tmp_path, budget=1024)
    assert residency.shared.roles() == {}, "not admitted: its budget could not hold a whole copy"
    assert all(torch.equal(v, expected[n]) for n, v in run(models, residency, x).items())
    assert not any(isinstance(layer.host, SharedHostLayer) for layer in residency.components["b"].streamer.layers)
    residency.remove()


def test_a_refused_read_only_pin_streams_store_layers_pageable(cpu_capacity, tmp_path,
                                                                                     monkeypatch):
    from offload_core.host import pinned
    from tests.offload_core.host.test_pinned import FakeLocker

    cpu_capacity(1 << 30)
    fake = FakeLocker(refuse=range(1, 1000))  # the device refuses every read-only registration
    monkeypatch.setattr(pinned, "page_locker", lambda device: fake)
    x = torch.randn(3, 16)
    expected = Toy(1)(x)
    node = InProcessLedger(1 << 30)
    models, residency = replica("r1", InProcessStoreRegistry(node), node, tmp_path)
    layers = residency.components["b"].streamer.layers
    assert {layer.tier for layer in layers} == {HostingTier.PAGEABLE}
    registrations = [c for c in fake.calls if c[0] == "register"]
    # The store's extents ask for read-only registration; the staging buffers the PAGEABLE layers
    # would copy through are the replica's own, writable memory (flags 0): refused here too, so
    # they are freed and those layers copied unstaged.
    store = [c for c in registrations if len(c) == 4]
    assert store and all(flags == 0x08 for *_, flags in store), "read-only registration"
    assert len(registrations) > len(store), "the staging buffers were asked for, writable"
    for component in residency.components.values():
        staging = component.streamer.staging
        assert staging.refusal is not None and staging.host_tensors() == () and component.streamer.staging_bytes == 0
    assert torch.equal(run(models, residency, x)["b"], expected)
    residency.remove()
    assert fake.locked == {}


def test_a_store_that_finds_no_room_in_shared_memory_leaves_the_replica_hosting_privately(cpu_capacity, tmp_path,
                                                                                         monkeypatch):
    import errno
    import os

    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    cpu_capacity(1 << 30)
    x = torch.randn(3, 16)
    expected = {n: m(x) for n, m in {"a": Toy(0), "b": Toy(1)}.items()}
    node = InProcessLedger(1 << 30)
    models, residency = replica("r1", InProcessStoreRegistry(node), node, tmp_path)
    assert residency.shared.roles() == {} and not list(tmp_path.glob("offload-serve-*"))
    assert all(torch.equal(v, expected[n]) for n, v in run(models, residency, x).items())
    assert node.leased() == residency.host_leased_bytes(), "no store lease left behind, only its own copy's"
    residency.remove()
    assert node.leased() == 0


def test_removing_a_replica_twice_detaches_it_once(cpu_capacity, tmp_path):
    cpu_capacity(1 << 30)
    node = InProcessLedger(1 << 30)
    registry = InProcessStoreRegistry(node)
    _, first = replica("r1", registry, node, tmp_path)
    _, second = replica("r2", registry, node, tmp_path)
    first.remove()
    first.remove()  # what a replica's __del__ does after an explicit close
    assert [a.attached for a in second.shared.attachments()] == [1, 1], "the second replica stays attached"
    second.remove()
    assert node.leased() == 0


def test_fp8_replicas_share_one_8bit_copy_and_equal_the_fake_quantized_model(cpu_capacity, tmp_path):
    """Issue 33: FP8 was hosted privately whenever a store could serve it (one 8-bit copy per replica)."""
    from offload_core.quant import WeightFormat, fake_quantize_
    from tests.offload_core.residency.test_lifecycle_fp8 import _plan

    cpu_capacity(1 << 30)
    node = InProcessLedger(1 << 30)
    registry = InProcessStoreRegistry(node)
    plan = _plan(WeightFormat.FP8, 1 << 30)
    reference = {"a": Toy(0, 32), "b": Toy(1, 32)}
    for model in reference.values():
        fake_quantize_(model.blocks)
    x = torch.randn(3, 32, generator=torch.Generator().manual_seed(4))
    expected = {n: m(x) for n, m in reference.items()}
    replicas = []
    for name, spoil in (("r1", False), ("r2", True)):
        models = {"a": Toy(0, 32), "b": Toy(1, 32)}
        if spoil:  # the second replica's own weights are NaN: equal outputs prove it used the store
            for model in models.values():
                for p in model.blocks.parameters():
                    p.data.fill_(float("nan"))
        shared = SharedWeights(registry, {"a": "toy32-a", "b": "toy32-b"}, name, tmp_path)
        replicas.append((models, PipelineResidency.apply(models, plan, "cpu", node, owner=name, shared=shared)))
    (_, first), (_, second) = replicas
    assert first.shared.roles() == {"a": StoreRole.CREATE, "b": StoreRole.CREATE}
    assert second.shared.roles() == {"a": StoreRole.ATTACH, "b": StoreRole.ATTACH}
    for models, residency in replicas:
        with torch.no_grad():
            got = run(models, residency, x)
        assert all(torch.equal(got[n], expected[n]) for n in expected), "FP8 from the store = fake-quantized"
        layers = residency.components["b"].streamer.layers
        assert all(isinstance(layer.host, SharedHostLayer) and layer.host.layout.quantized for layer in layers)
    assert node.leased() == sum(a.nbytes for a in first.shared.attachments()), "leased once for both replicas"
    # What the store holds per layer: 8-bit values, float32 scales and the kept bias, each aligned (the fp32 toy: 8,192 of 18,432 B).
    fp8_layers = first.shared.key("b", Toy(1, 32), None, WeightFormat.FP8)[1].layer_bytes
    native_layers = first.shared.key("b", Toy(1, 32), None)[1].layer_bytes
    assert fp8_layers < 0.5 * native_layers, (fp8_layers, native_layers)
    for _, residency in replicas:
        residency.remove()
    assert node.leased() == 0
