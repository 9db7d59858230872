"""Tensor-parallel plans: the T5-family encoders over 2 gloo ranks match the unsharded encoder.

Two real processes on a CPU gloo group load their slice through transformers'
``DistributedConfig(tp_size=2, tp_plan=...)``; the offloaded rank (layerwise, host tables
asked for at any size) is bitwise the plain sharded rank, and both match the unsharded model.
"""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from offload_core.layout import unique_storage_bytes
from offload_core.planner.facts import LinkFacts, PipelineFacts, Stage, profile_component
from offload_core.planner.pipeline_plan import ComponentOverride
from offload_core.planner.search import PerformanceMode, plan_pipeline
from offload_core.planner.strategy import Strategy
from offload_core.residency.lifecycle import PipelineResidency
from offload_core.tables import HostTablesConfig
from offload_core.tensor_parallel.plans import NoTensorParallelPlan, load_rank, tp_plan_for
from tests import ranks
from tests.offload_core.tp_fixtures import tiny_t5, tiny_umt5

# fp32 over 2 ranks: the all-reduces sum partial products in another order than one matmul does.
TOLERANCE = 1e-5
ANY_SIZE = HostTablesConfig(min_bytes=0)


def test_a_class_without_a_plan_is_refused_naming_the_classes_with_plans():
    with pytest.raises(NoTensorParallelPlan, match=r"CLIPTextModel has no tensor-parallel plan.*"
                                                   r"\['FluxTransformer2DModel', 'QwenImageTransformer2DModel', "
                                                   r"'T5EncoderModel', 'UMT5EncoderModel'\]"):
        tp_plan_for("CLIPTextModel", None)


def _offloaded(model):
    profile = profile_component("enc", model, uses_per_request=1, tables=ANY_SIZE)
    facts = PipelineFacts((profile,), (Stage("encode", ("enc",)),), 1 << 30,
                          LinkFacts(pinned_Bps=25e9, pageable_Bps=8e9), host_lease_bytes=1 << 30)
    override = ComponentOverride(strategy=Strategy.LAYERWISE, host_tables=True, park=True)
    plan = plan_pipeline(facts, PerformanceMode.MEMORY, {"enc": override})
    return PipelineResidency.apply({"enc": model}, plan, "cpu", tables=ANY_SIZE)


def _rank(rank: int, world: int, init_file: str, out_dir: str, folders: dict[str, str]):
    from transformers import T5EncoderModel, UMT5EncoderModel

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        ids = torch.tensor([[5, 17, 300, 4000, 2048, 1], [9, 2047, 2049, 3, 1, 0]])
        mask = (ids != 0).long()
        result = {}
        for cls in (UMT5EncoderModel, T5EncoderModel):
            folder = folders[cls.__name__]
            model = load_rank(cls, folder, world, rank, torch_dtype=torch.float32)
            with torch.no_grad():
                plain = model(input_ids=ids, attention_mask=mask).last_hidden_state
            residency = _offloaded(model)
            with torch.no_grad(), residency.following_calls():
                offloaded = model(input_ids=ids, attention_mask=mask).last_hidden_state
            [table] = residency.report().component("enc").tables
            residency.remove()
            entry = {"bitwise": torch.equal(offloaded, plain), "table": table.verdict.value,
                     "local_rows": model.shared.weight.to_local().shape[0],
                     # what the rank's memory holds: its shards' storages, not the loader's whole tensors
                     "held": unique_storage_bytes(model.parameters())}
            with torch.no_grad():
                whole = cls.from_pretrained(folder, torch_dtype=torch.float32).eval()
                reference = whole(input_ids=ids, attention_mask=mask).last_hidden_state
            entry["max_diff"] = (plain - reference).abs().max().item()
            entry["whole"] = unique_storage_bytes(whole.parameters())
            result[cls.__name__] = entry
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_t5_family_encoders_over_two_gloo_ranks_match_the_unsharded_encoder(tmp_path):
    folders = {}
    for model in (tiny_umt5(), tiny_t5()):
        folder = tmp_path / type(model).__name__
        model.save_pretrained(folder)
        folders[type(model).__name__] = str(folder)
    ranks.spawn(_rank, (2, str(tmp_path / "init"), str(tmp_path), folders), nprocs=2)
    for rank in range(2):
        result = torch.load(tmp_path / f"rank{rank}.pt")
        for name, entry in result.items():
            assert entry["bitwise"] and entry["table"] == "sharded" and entry["local_rows"] == 2048, (rank, name, entry)
            assert entry["held"] <= 0.55 * entry["whole"], (rank, name, entry)
            print(f"{name} rank {rank}: tp 2 vs unsharded max |diff| = {entry['max_diff']:.3g}, "
                  f"holds {entry['held']} of {entry['whole']} B")
            assert entry["max_diff"] <= TOLERANCE, (name, entry)
