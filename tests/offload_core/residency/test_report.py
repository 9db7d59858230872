"""The residency report on a real streamed model: bytes per place, each byte once, as planned."""
from __future__ import annotations

import json

import pytest
import torch

from offload_core.host.budget import InProcessLedger
from offload_core.host.hosting import HostingPolicy, plan_hosting
from offload_core.host.on_host import layers_on_host
from offload_core.host.tier import HostingTier
from offload_core.residency.parking import Parking
from offload_core.residency.report import component_residency, residency_report
from offload_core.streaming.engine import StreamingConfig, apply_layer_streaming

PINNED, PAGEABLE, MAPPED = HostingTier.PINNED, HostingTier.PAGEABLE, HostingTier.MAPPED
CPU = torch.device("cpu")


def _param_bytes(module: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def _buffer_bytes(module: torch.nn.Module) -> int:
    return sum(b.numel() * b.element_size() for b in module.buffers())


@pytest.fixture(scope="module")
def wan_folder(tmp_path_factory):
    from diffusers import WanTransformer3DModel

    torch.manual_seed(0)
    model = WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16, in_channels=4,
        out_channels=4, text_dim=32, freq_dim=32, ffn_dim=64, num_layers=6, rope_max_seq_len=32)
    folder = tmp_path_factory.mktemp("wan")
    model.save_pretrained(str(folder))
    return folder


def _load(folder):
    from diffusers import WanTransformer3DModel

    return WanTransformer3DModel.from_pretrained(str(folder)).eval()


def _inputs():
    g = torch.Generator().manual_seed(1)
    return dict(hidden_states=torch.randn(1, 4, 2, 8, 8, generator=g), timestep=torch.tensor([500]),
                encoder_hidden_states=torch.randn(1, 8, 32, generator=g), return_dict=False)


def test_a_planned_streamed_model_is_bitwise_equal_and_reported_where_the_plan_put_it(wan_folder, remove_after):
    with torch.no_grad():
        expected = _load(wan_folder)(**_inputs())[0]
    model = _load(wan_folder)
    facts = layers_on_host("transformer", model, ["blocks"], uses_per_request=50)
    per_layer = facts.layers[0].mapped_bytes
    assert per_layer == facts.layers[0].nbytes > 0, "from_pretrained keeps same-dtype weights mapped"
    # Room for three layers' net cost and the staging buffers (two of the largest layer) the
    # pageable and mapped layers are copied through; a cap of 2 layers on pins leaves one
    # pageable, the rest mapped.
    staging = 2 * max(layer.host_bytes for layer in facts.layers)
    ledger = InProcessLedger(3 * facts.layers[0].consolidation_cost + staging)
    plan = plan_hosting([facts], ledger, "r", HostingPolicy(max_pinned_bytes=2 * facts.layers[0].host_bytes))
    tiers = plan.tiers_for("transformer")
    assert [tiers[f"blocks.{i}"] for i in range(6)] == [PINNED, PINNED, PAGEABLE, MAPPED, MAPPED, MAPPED]

    streamer = remove_after(apply_layer_streaming(model, CPU, StreamingConfig(hosting=tiers)))
    with pytest.raises(ValueError, match="before apply_layer_streaming"):
        layers_on_host("transformer", model, ["blocks"], uses_per_request=50)
    with torch.no_grad():
        streamer.prepare_for_use()
        got = model(**_inputs())[0]
        streamer.finish_use()
    assert torch.equal(got, expected)

    rep = component_residency("transformer", model, streamer=streamer, device=CPU)
    by_tier = {t: sum(l.host.nbytes for l in streamer.layers if l.tier is t) for t in HostingTier}
    assert rep.host_staging_bytes == streamer.staging_bytes == staging, "the staging buffers, as planned"
    assert rep.host_pinned_bytes == by_tier[PINNED] + staging and by_tier[PINNED] >= 2 * per_layer
    assert rep.host_pageable_bytes == by_tier[PAGEABLE] >= per_layer
    assert rep.host_mapped_bytes == 3 * per_layer, "mapped layers stay views of the checkpoint"
    planned = plan.component("transformer")
    assert (rep.host_pinned_bytes - rep.host_staging_bytes, rep.host_pageable_bytes, rep.host_mapped_bytes,
            rep.host_staging_bytes) == (planned.pinned_bytes, planned.pageable_bytes, planned.mapped_bytes,
                                        planned.staging_bytes), "the plan accounts what is there"
    assert planned.net_cost == rep.host_pinned_bytes + rep.host_pageable_bytes == plan.lease.nbytes
    assert rep.device_bytes == streamer.non_layer_bytes + _buffer_bytes(model), \
        "after finish_use only non-layer weights (and buffers) stay"
    assert dict(rep.layer_tiers) == {"pinned": 2, "pageable": 1, "mapped": 3}
    streamer.remove()
    plan.release(ledger)
    assert ledger.leased() == 0


def test_materialized_layers_count_on_the_device_once(wan_folder, remove_after):
    model = _load(wan_folder)
    streamer = remove_after(apply_layer_streaming(model, CPU, StreamingConfig(resident=2, keep_resident=True)))
    with torch.no_grad():
        streamer.prepare_for_use()
        model(**_inputs())
        streamer.finish_use()  # keep_resident: the two resident layers stay materialized
    rep = component_residency("transformer", model, streamer=streamer, device=CPU)
    resident = sum(l.nbytes for l in streamer.layers if l.resident)
    assert streamer.meter.current_bytes == streamer.non_layer_bytes + resident
    assert rep.device_bytes == streamer.meter.current_bytes + _buffer_bytes(model)
    assert rep.host_pageable_bytes == sum(l.host.nbytes for l in streamer.layers)


def test_a_layer_planned_mapped_but_copied_out_is_reported_pageable(wan_folder, remove_after):
    from diffusers import WanTransformer3DModel

    model = WanTransformer3DModel.from_pretrained(str(wan_folder), torch_dtype=torch.bfloat16).eval()
    block_bytes = _param_bytes(model.blocks)
    fp32_kept = sum(p.numel() * 4 for p in model.blocks.parameters() if p.dtype == torch.float32)
    assert 0 < fp32_kept < block_bytes
    mapped = StreamingConfig(hosting={f"blocks.{i}": MAPPED for i in range(6)})
    streamer = remove_after(apply_layer_streaming(model, CPU, mapped))
    rep = component_residency("transformer", model, streamer=streamer, device=CPU)
    assert rep.host_mapped_bytes == sum(
        sum(t.numel() * t.element_size() for t in l.host_tensors() if t.dtype == torch.float32)
        for l in streamer.layers) == fp32_kept, "only the fp32-kept tensors are still views of the file"
    assert rep.host_pageable_bytes == block_bytes - fp32_kept


def test_parked_weights_and_tied_tensors_count_once():
    model = torch.nn.Sequential(torch.nn.Embedding(100, 16), torch.nn.Linear(16, 100, bias=False))
    model[1].weight = model[0].weight  # tied: one storage behind two parameters
    parking = Parking("enc", model, CPU, fraction=0.0)
    before = component_residency("enc", model, parking=parking, device=CPU)
    assert (before.device_bytes, before.parked_bytes) == (100 * 16 * 4, 0)
    parking.park()
    after = component_residency("enc", model, parking=parking, device=CPU)
    assert (after.device_bytes, after.parked_bytes) == (0, 100 * 16 * 4)


def test_report_json_and_one_log_line(wan_folder, caplog, remove_after):
    model = _load(wan_folder)
    streamer = remove_after(apply_layer_streaming(model, CPU, StreamingConfig(hosting={"blocks.0": PINNED})))
    with caplog.at_level("INFO", logger="offload_core.residency.report"):
        report = residency_report({"transformer": model}, streamers={"transformer": streamer}, device=CPU)
    lines = [r.getMessage() for r in caplog.records if r.name == "offload_core.residency.report"]
    assert len(lines) == 1 and lines[0].startswith("residency transformer: device")
    data = json.loads(json.dumps(report.to_json()))
    comp = data["components"][0]
    assert comp["name"] == "transformer" and comp["layer_tiers"] == {"pinned": 1, "pageable": 5, "mapped": 0}
    assert data["totals"]["host_pinned_bytes"] == comp["host_pinned_bytes"] > 0
    with pytest.raises(ValueError, match="not given"):
        residency_report({"transformer": model}, streamers={"vae": streamer})


def test_views_of_one_buffer_are_counted_by_byte_range():
    from offload_core.residency.report import _ByteRanges

    ranges = _ByteRanges()
    assert ranges.claim(100, 200) == 100
    assert ranges.claim(150, 250) == 50, "the overlap was already counted"
    assert ranges.claim(0, 300) == 150
    assert ranges.claim(300, 310) == 10 and ranges.claim(0, 310) == 0
