"""Reading and checking adapters (a clear LoraError at deploy, naming adapter and module), and the device budget:
LRU eviction, reload on use, and an adapter larger than the budget refused."""
from __future__ import annotations

import json
import logging

import pytest
import torch
from safetensors.torch import save_file

from offload_core.lora import LoraAdapter, LoraError, apply_lora, check_fits, linear_flops, load_lora, lora_flops
from tests.offload_core.lora.adapters import random_weights, save_diffusers, save_peft
from tests.offload_core.tiny_models import WAN


@pytest.fixture(scope="module")
def wan():
    return WAN.build()


def _adapter(weights, name="a") -> LoraAdapter:
    return LoraAdapter(name=name, scale=1.0, rank=next(iter(weights.values()))[0].shape[0], alpha=None,
                       weights=weights)


def test_an_adapter_that_fits_passes_and_reads_the_diffusers_keys(wan, tmp_path):
    weights = random_weights(wan, rank=4)
    adapter = load_lora(save_diffusers(weights, tmp_path / "a.safetensors"), "a", scale=0.6)
    check_fits(adapter, wan)
    assert (adapter.name, adapter.scale, adapter.rank, adapter.alpha) == ("a", 0.6, 4, None)
    assert set(adapter.weights) == set(weights) and adapter.nbytes == sum(a.nbytes + b.nbytes for a, b in
                                                                           weights.values())
    assert torch.equal(adapter.weights["blocks.0.attn1.to_q"][0], weights["blocks.0.attn1.to_q"][0])


def test_the_older_down_up_keys_read_as_a_and_b(wan, tmp_path):
    a, b = random_weights(wan, modules=["blocks.1.ffn.net.2"])["blocks.1.ffn.net.2"]
    save_file({"transformer.blocks.1.ffn.net.2.lora.down.weight": a, "transformer.blocks.1.ffn.net.2.lora.up.weight": b,
               "text_encoder.x.lora_A.weight": torch.zeros(4, 2)}, str(tmp_path / "old.safetensors"))
    adapter = load_lora(tmp_path / "old.safetensors", "old")
    assert list(adapter.weights) == ["blocks.1.ffn.net.2"]  # another component's keys are not this one's
    assert torch.equal(adapter.weights["blocks.1.ffn.net.2"][1], b)


@pytest.mark.parametrize("module,change,words", [
    ("blocks.9.attn1.to_q", None, "'blocks.9.attn1.to_q' is not in WanTransformer3DModel"),
    ("blocks.0.norm2", None, "'blocks.0.norm2' is a FP32LayerNorm, not an nn.Linear"),
    ("blocks.0.attn1.to_q", "in", "takes 24 input features, the adapter's A is (4, 23)"),
    ("blocks.0.attn1.to_q", "out", "gives 24 output features, the adapter's B is (25, 4)"),
])
def test_check_fits_names_the_adapter_the_module_and_the_mismatch(wan, module, change, words):
    weights = random_weights(wan, rank=4, modules=["blocks.0.attn1.to_k"])
    a, b = torch.randn(4, 23 if change == "in" else 24), torch.randn(25 if change == "out" else 24, 4)
    weights[module] = (a, b)
    with pytest.raises(LoraError, match="'a'") as error:
        check_fits(_adapter(weights), wan)
    assert words in str(error.value)


def test_a_rank_that_differs_between_modules_or_between_a_and_b_is_refused_at_load(wan, tmp_path):
    weights = random_weights(wan, rank=4, modules=["blocks.0.attn1.to_q"])
    weights.update(random_weights(wan, rank=8, modules=["blocks.0.attn1.to_k"]))
    with pytest.raises(LoraError, match="'blocks.0.attn1.to_q' has rank 4 but 'blocks.0.attn1.to_k' has rank 8"):
        load_lora(save_diffusers(weights, tmp_path / "r.safetensors"), "r")
    a, _ = weights["blocks.0.attn1.to_q"]
    weights = {"blocks.0.attn1.to_q": (a, torch.randn(24, 3))}
    with pytest.raises(LoraError, match="A of rank 4 but B of rank 3"):
        load_lora(save_diffusers(weights, tmp_path / "ab.safetensors"), "ab")
    save_file({"transformer.blocks.0.attn1.to_q.lora_A.weight": a}, str(tmp_path / "half.safetensors"))
    with pytest.raises(LoraError, match="'half'.*only its A"):
        load_lora(tmp_path / "half.safetensors", "half")


def test_only_safetensors_files_are_read(tmp_path):
    (tmp_path / "a.bin").write_bytes(b"x")
    with pytest.raises(LoraError, match="only .safetensors"):
        load_lora(tmp_path / "a.bin", "a")
    (tmp_path / "bad.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(LoraError, match="'bad'.*not a readable safetensors"):
        load_lora(tmp_path / "bad.safetensors", "bad")


def test_adapters_are_evicted_least_recently_used_under_the_budget_and_reloaded_when_named(wan, caplog):
    adapters = [_adapter(random_weights(wan, rank=4, seed=i), name) for i, name in enumerate("abc")]
    size = adapters[0].nbytes  # fp32 file, fp32 model: device bytes = host bytes
    loras = apply_lora(wan, "cpu", budget_bytes=2 * size)
    try:
        caplog.set_level(logging.INFO, logger="offload_core.lora")
        loras.load(adapters[0])
        loras.load(adapters[1])
        with loras.rows([("a", 1.0)]):  # a is used: b is now the least recently used
            pass
        loras.load(adapters[2])
        assert [entry.name for entry in loras.loaded()] == ["c", "a"] and loras.device_bytes == 2 * size
        assert any(f"'b' evicted from cpu (least recently used): {size} B freed for {size} B wanted" in r.message
                   for r in caplog.records)
        with loras.rows([("b", 1.0), ("c", 1.0)]):  # b comes back; a (unused since) goes
            pass
        assert sorted(entry.name for entry in loras.loaded()) == ["b", "c"]
        loras.evict("c")
        assert [entry.name for entry in loras.loaded()] == ["b"]
        with pytest.raises(LoraError, match="'c' is not on the device"):
            loras.evict("c")
    finally:
        loras.close()


def test_an_adapter_larger_than_the_budget_or_a_batch_over_it_is_refused(wan):
    a, b = (_adapter(random_weights(wan, rank=4, seed=i), name) for i, name in enumerate("ab"))
    loras = apply_lora(wan, "cpu", budget_bytes=a.nbytes - 1)
    with pytest.raises(LoraError, match=f"'a' needs {a.nbytes} B on cpu, over the whole adapter budget"):
        loras.load(a)
    loras.close()
    loras = apply_lora(wan, "cpu", budget_bytes=a.nbytes + 1)
    loras.load(a)
    loras.load(b)  # evicts a
    with pytest.raises(LoraError, match=r"adapters \['a', 'b'\] need"):
        with loras.rows([("a", 1.0), ("b", 1.0)]):
            pass
    loras.close()


def test_the_device_copy_takes_each_linears_dtype(tmp_path):
    model = WAN.build().to(torch.bfloat16)
    path = save_diffusers(random_weights(WAN.build(), rank=4), tmp_path / "a.safetensors")
    loras = apply_lora(model, "cpu", budget_bytes=1 << 24)
    loaded = loras.load(load_lora(path, "a"))
    assert loaded.nbytes == load_lora(path, "a").nbytes // 2  # fp32 file, bf16 on the device
    loras.close()


def test_lora_flops_count_both_low_rank_matmuls():
    assert lora_flops(4, [(24, 32)], tokens=10) == 2 * 10 * 4 * (24 + 32)
    assert linear_flops([(24, 32)], tokens=10) == 2 * 10 * 24 * 32


def test_an_adapter_a_forward_routes_is_not_evicted_until_the_forward_ends(wan):
    adapters = {name: _adapter(random_weights(wan, rank=4, seed=i), name) for i, name in enumerate("abc")}
    loras = apply_lora(wan, "cpu", budget_bytes=2 * adapters["a"].nbytes)
    try:
        loras.load(adapters["a"])
        loras.load(adapters["b"])
        with loras.rows([("a", 1.0)]):
            loras.load(adapters["b"])  # b is the most recently used now, a the least, but a is routed
            loras.load(adapters["c"])  # (another thread's load, say): b goes, not a
            assert sorted(entry.name for entry in loras.loaded()) == ["a", "c"]
        loras.load(adapters["b"])  # a's forward is over: a, now least recently used, goes
        assert sorted(entry.name for entry in loras.loaded()) == ["b", "c"]
    finally:
        loras.close()


@pytest.mark.parametrize("setting,words", [({"use_rslora": True}, "use_rslora"), ({"use_dora": True}, "use_dora"),
                                           ({"rank_pattern": {"blocks.0.attn1.to_q": 8}}, "rank_pattern")])
def test_a_peft_config_asking_for_another_scaling_is_refused(wan, tmp_path, setting, words):
    folder = save_peft(random_weights(wan, rank=4, modules=["blocks.0.attn1.to_q"]), tmp_path / "p", alpha=8.0)
    config = json.loads((folder / "adapter_config.json").read_text())
    (folder / "adapter_config.json").write_text(json.dumps({**config, **setting}))
    with pytest.raises(LoraError, match=f"'p'.*{words}"):
        load_lora(folder, "p")


def test_a_linear_sharded_over_tensor_parallel_ranks_is_refused(tmp_path):
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    from tests.offload_core.tp_fixtures import fake_world

    model = torch.nn.Sequential(torch.nn.Linear(8, 8))
    adapter = _adapter(random_weights(model, rank=2, modules=["0"]))
    check_fits(adapter, model)
    with fake_world(2) as mesh:
        parallelize_module(model, mesh, {"0": ColwiseParallel()})
        with pytest.raises(LoraError, match="'a'.*module '0' is sharded over tensor-parallel ranks"):
            check_fits(adapter, model)
