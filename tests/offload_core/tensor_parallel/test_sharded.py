"""Tensor-parallel (DTensor) parameters under the engine: never rebound, never hosted, counted at local bytes.

In one process, on a fake process group of 2 ranks (tests/offload_core/tp_fixtures.py): every
sharded parameter is a real DTensor holding rank 0's half. The forward over real ranks is in
test_tensor_parallel.py.
"""
from __future__ import annotations

import torch

from offload_core.layout import layer_parameters, unique_storage_bytes
from offload_core.planner.facts import LinkFacts, PipelineFacts, Stage, profile_component
from offload_core.planner.pipeline_plan import ComponentOverride
from offload_core.planner.search import PerformanceMode, plan_pipeline
from offload_core.planner.strategy import Strategy
from offload_core.residency.host_tables import device_weight_bytes
from offload_core.residency.lifecycle import PipelineResidency
from offload_core.streaming.engine import StreamingConfig, apply_layer_streaming
from offload_core.streaming.meter import walked_device_bytes
from offload_core.tables import HostTablesConfig, TableVerdict
from offload_core.tensor_parallel.sharded import local_nbytes, sharded_parameters
from tests.offload_core.tp_fixtures import fake_world, sharded, tiny_umt5

# Zero: "too small" can never be why the table stays on the device; only the tensor-parallel rule can.
ANY_SIZE = HostTablesConfig(min_bytes=0)


def _identity(model) -> dict[str, tuple]:
    """Each DTensor parameter: its object, global shape, local shape and local storage."""
    return {n: (id(p), tuple(p.shape), tuple(p.to_local().shape), p.to_local().data_ptr())
            for n, p in sharded_parameters(model)}


def _plan(model, **override):
    profile = profile_component("text_encoder", model, uses_per_request=1, tables=ANY_SIZE)
    facts = PipelineFacts((profile,), (Stage("encode", ("text_encoder",)),), 1 << 30,
                          LinkFacts(pinned_Bps=25e9, pageable_Bps=8e9), host_lease_bytes=1 << 30)
    return profile, plan_pipeline(facts, PerformanceMode.MEMORY, {"text_encoder": ComponentOverride(**override)})


def test_a_sharded_token_table_stays_on_the_device_with_host_tables_requested_and_the_report_says_why():
    with fake_world(2) as mesh:
        model = sharded(tiny_umt5(), mesh)
        before = _identity(model)
        table = model.shared.weight
        _, plan = _plan(model, strategy=Strategy.LAYERWISE, host_tables=True, park=True)
        assert plan.component("text_encoder").host_tables
        residency = PipelineResidency.apply({"text_encoder": model}, plan, "cpu", tables=ANY_SIZE)
        try:
            report = residency.report().component("text_encoder")
            [decision] = report.tables
            assert decision.verdict is TableVerdict.SHARDED, decision
            assert "tensor-parallel" in decision.reason and "(2048, 32) of (4096, 32)" in decision.reason
            assert decision.nbytes == 2048 * 32 * 4  # rank 0's half, not the 4096-row table
            assert report.to_json()["tables"][0]["verdict"] == "sharded"
            # Still the one tied DTensor, whole, on the device, with no host gather hooked on it.
            assert model.shared.weight is table and model.encoder.embed_tokens.weight is table
            assert not model.shared._forward_hooks and not model.encoder.embed_tokens._forward_pre_hooks
            with residency.stage(["text_encoder"]):
                assert _identity(model) == before
        finally:
            residency.remove()
        assert _identity(model) == before


def test_the_engine_streams_only_unsharded_parameters_and_never_rebinds_a_dtensor():
    with fake_world(2) as mesh:
        model = sharded(tiny_umt5(), mesh)
        before = _identity(model)
        streamed = {n for n, _ in layer_parameters(model.encoder.block[0])}
        assert streamed == {"layer.0.SelfAttention.relative_attention_bias.weight", "layer.0.layer_norm.weight",
                            "layer.1.layer_norm.weight"}, streamed
        streamer = apply_layer_streaming(model, "cpu", StreamingConfig(prefetch_depth=1))
        try:
            streamer.prepare_for_use()
            assert _identity(model) == before
            streamer.finish_use()
            assert _identity(model) == before
        finally:
            streamer.remove()
        assert _identity(model) == before


def test_every_byte_count_is_a_ranks_local_bytes():
    with fake_world(2) as mesh:
        model = sharded(tiny_umt5(), mesh)
        params = list(model.parameters())  # each once: the tied table counted once
        local = sum(local_nbytes(p) for p in params)
        global_ = sum(p.numel() * p.element_size() for p in params)
        assert local < 0.55 * global_, (local, global_)
        assert unique_storage_bytes(params) == local
        assert walked_device_bytes(params, torch.device("cpu")) == local
        assert device_weight_bytes(model) == local
        profile, plan = _plan(model, strategy=Strategy.RESIDENT)
        streamed = sum(layer.nbytes for layer in profile.layers)
        kept = sum(local_nbytes(p) for _, p in sharded_parameters(model))
        assert kept <= profile.non_layer_bytes and profile.table_bytes == 0
        # The layers stream only their layer norms and bias tables: the rest is kept (local) bytes.
        assert streamed < 0.05 * local
        residency = PipelineResidency.apply({"text_encoder": model}, plan, "cpu")
        try:
            assert residency.device_bytes_now() == local == residency.report().component("text_encoder").device_bytes
        finally:
            residency.remove()


def test_a_calls_activation_peak_is_measured_through_dtensors_and_collective_outputs():
    from offload_core.residency.activation_meter import measure_activations

    with fake_world(2) as mesh:
        model = sharded(tiny_umt5(), mesh)
        ids = torch.tensor([[5, 17, 300, 1]])
        with torch.no_grad():
            _, measured = measure_activations(lambda: model(input_ids=ids).last_hidden_state, "cpu",
                                              list(model.parameters()))
        # DTensor weights and the all-reduces' wrapped outputs have no storage of their own: counted
        # through their inner tensors, the call's hidden states (4 tokens x 32 fp32 = 512 B) at least.
        assert measured.peak_bytes >= 4 * 32 * 4, measured
