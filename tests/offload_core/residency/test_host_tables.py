"""Host-resident embedding tables: selection rules, the round trip, the host gather, device bytes."""
from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from offload_core.planner.real_models import meta_component
from offload_core.residency.host_tables import apply_host_tables, device_weight_bytes
from offload_core.tables import HostTablesConfig, TableVerdict, declared_table_names, select_host_tables
from tests import ranks

LOW = HostTablesConfig(min_bytes=1024)


def tiny_umt5():
    from transformers import UMT5Config, UMT5EncoderModel

    torch.manual_seed(0)
    cfg = UMT5Config(vocab_size=4096, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                     feed_forward_proj="gated-gelu")
    return UMT5EncoderModel(cfg).eval()


class Declared(nn.Module):
    host_resident_table_names = ("inner.table", "absent.table")

    def __init__(self):
        super().__init__()
        self.inner = nn.Module()
        self.inner.table = nn.Embedding(1000, 16)
        self.small = nn.Embedding(4, 4)
        self.proj = nn.Linear(16, 8)

    def forward(self, ids):
        return self.proj(self.inner.table(ids))


class Undeclared(nn.Module):
    def __init__(self):
        super().__init__()
        self.table = nn.Embedding(1000, 16)


class TiedToHead(nn.Module):
    host_resident_table_names = ("embed",)

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(1000, 16)
        self.head = nn.Linear(16, 1000, bias=False)
        self.head.weight = self.embed.weight


def test_a_declared_dotted_path_is_hosted_and_a_missing_path_is_reported():
    decisions = {d.path: d for d in select_host_tables(Declared(), LOW)}
    assert decisions["inner.table"].verdict is TableVerdict.HOSTED
    assert decisions["inner.table"].nbytes == 1000 * 16 * 4
    assert decisions["absent.table"].verdict is TableVerdict.MISSING


def test_an_undeclared_model_is_never_touched():
    model = Undeclared()
    assert select_host_tables(model, LOW) == ()
    tables = apply_host_tables(model, "cpu", LOW)
    assert tables.hosted == () and not model.table._forward_hooks


def test_a_table_under_the_threshold_stays_on_the_device():
    (decision, *_) = select_host_tables(Declared(), HostTablesConfig(min_bytes=1000 * 16 * 4 + 1))
    assert decision.verdict is TableVerdict.TOO_SMALL


def test_a_table_tied_to_an_output_head_is_never_hosted():
    (decision,) = select_host_tables(TiedToHead(), LOW)
    assert decision.verdict is TableVerdict.TIED_TO_HEAD


def test_a_table_with_tp_size_above_one_stays_on_the_device():
    model = Declared()
    model.inner.table.tp_size = 2
    decisions = {d.path: d for d in select_host_tables(model, LOW)}
    assert decisions["inner.table"].verdict is TableVerdict.SHARDED


def test_umt5_table_and_its_tied_alias_are_one_table():
    model = tiny_umt5()
    assert declared_table_names(model) == ("shared",)
    (decision,) = select_host_tables(model, LOW)
    assert decision.verdict is TableVerdict.HOSTED
    assert set(decision.module_paths) == {"shared", "encoder.embed_tokens"}


def test_detached_round_trip_leaves_the_table_out_of_a_move_and_puts_the_same_parameter_back():
    model = tiny_umt5()
    weight = model.shared.weight
    tables = apply_host_tables(model, "cpu", LOW, move=False)
    with tables.detached():
        assert model.shared.weight is None and model.encoder.embed_tokens.weight is None
        model.to(torch.float64)  # a move that would have converted the table
    assert model.shared.weight is weight and model.encoder.embed_tokens.weight is weight
    assert weight.dtype == torch.float32 and model.encoder.block[0].layer[0].SelfAttention.q.weight.dtype == torch.float64


def test_host_gather_output_is_bitwise_equal_to_a_plain_lookup():
    plain = tiny_umt5()
    hosted = tiny_umt5()
    tables = apply_host_tables(hosted, "cpu", LOW)
    ids = torch.randint(0, 4096, (2, 7))
    with torch.no_grad():
        assert torch.equal(hosted.encoder.embed_tokens(ids), plain.encoder.embed_tokens(ids))
        assert torch.equal(hosted(input_ids=ids).last_hidden_state, plain(input_ids=ids).last_hidden_state)
    tables.remove()
    assert not hosted.shared._forward_hooks and not hosted.shared._forward_pre_hooks


def test_real_size_umt5_xxl_device_bytes_drop_by_exactly_the_3_91_gib_table():
    model = meta_component("wan2.1-t2v-14b", "text_encoder")
    before = device_weight_bytes(model)
    tables = apply_host_tables(model, "meta", HostTablesConfig(), move=False)
    table_bytes = 256384 * 4096 * 4
    assert sum(d.nbytes for d in tables.hosted) == table_bytes and round(table_bytes / 2**30, 2) == 3.91
    assert before - device_weight_bytes(model, tables) == table_bytes


# ---- the sharded case, for real: two processes on a CPU gloo group ---------------------------------

VOCAB, DIM = 64, 8


class VocabParallelEmbedding(nn.Embedding):
    """Each rank holds vocab/world rows; out-of-range ids give zeros; all_reduce sums the parts.

    An ``nn.Embedding`` whose weight nothing else holds: untied and far over the threshold, so the
    tensor-parallel rule is the only one that keeps it on the device.
    """

    def __init__(self, full: torch.Tensor, rank: int, world: int):
        per = full.shape[0] // world
        super().__init__(per, full.shape[1], _weight=full[rank * per:(rank + 1) * per].clone())
        self.tp_size = world
        self.start, self.end = rank * per, (rank + 1) * per

    def forward(self, ids):
        outside = (ids < self.start) | (ids >= self.end)
        rows = F.embedding((ids - self.start).masked_fill(outside, 0), self.weight)
        rows = rows.masked_fill(outside.unsqueeze(-1), 0.0)
        dist.all_reduce(rows)
        return rows


class TinyEncoder(nn.Module):
    host_resident_table_names = ("embed",)

    def __init__(self, embed: nn.Module, proj: nn.Linear):
        super().__init__()
        self.embed, self.proj = embed, proj

    def forward(self, ids):
        return self.proj(self.embed(ids))


def _sharded_worker(rank: int, world: int, init_file: str, out_dir: str):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        full, proj = torch.randn(VOCAB, DIM), nn.Linear(DIM, 4)
        ids = torch.randint(0, VOCAB, (3, 5))
        plain = TinyEncoder(nn.Embedding.from_pretrained(full), proj)
        sharded = TinyEncoder(VocabParallelEmbedding(full, rank, world), proj)
        tables = apply_host_tables(sharded, "cpu", HostTablesConfig(min_bytes=0))
        with torch.no_grad():
            result = {"verdicts": [d.verdict.value for d in tables.decisions], "hosted": len(tables.hosted),
                      "hooks": len(sharded.embed._forward_hooks), "equal": torch.equal(sharded(ids), plain(ids))}
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_a_vocab_sharded_table_feeding_an_all_reduce_stays_on_the_device_and_matches_unsharded(tmp_path):
    ranks.spawn(_sharded_worker, (2, str(tmp_path / "init"), str(tmp_path)), nprocs=2)
    for rank in range(2):
        result = torch.load(tmp_path / f"rank{rank}.pt")
        assert result == {"verdicts": ["sharded"], "hosted": 0, "hooks": 0, "equal": True}, result
