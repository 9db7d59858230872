"""Adapters on a streamed model whose blocks are compiled (offload_core.compile): the adapted Linears' hooks run
eagerly at graph breaks, so a new routing (other scales, other rows) never recompiles, and the output equals the
eager model's. The backend is dynamo's ``eager`` (no inductor codegen: seconds, not a minute, on the 2-core VM);
what is pinned here is dynamo's tracing of the hooks, which the backend does not change."""
from __future__ import annotations

from offload_core.compile import CompileConfig, apply_block_compile
from offload_core.lora import apply_lora, load_lora
from offload_core.streaming.engine import apply_layer_streaming
from tests.offload_core.lora.adapters import random_weights, save_diffusers
from tests.offload_core.lora.test_rows import _batch
from tests.offload_core.tiny_models import WAN

ROUTINGS = ([("x", 0.7), None], [None, ("x", 0.3)], [("x", 1.1), ("x", 0.2)], [None, None])


def test_a_new_routing_under_block_compile_never_recompiles_and_equals_eager(tmp_path):
    model = WAN.build()
    loras = apply_lora(model, "cpu", budget_bytes=1 << 24)
    loras.load(load_lora(save_diffusers(random_weights(model, seed=1), tmp_path / "x.safetensors"), "x"))
    inputs = _batch(WAN, 2)
    eager = []
    for per_row in ROUTINGS:
        with loras.rows(per_row):
            eager.append(WAN.run(model, inputs))
    streamer = apply_layer_streaming(model, "cpu")
    blocks = apply_block_compile(model, CompileConfig(backend="eager"))
    try:
        with loras.rows(ROUTINGS[0]):
            first = WAN.run(model, inputs)  # compiles (falls back to graph breaks at the hooks)
        graphs = blocks.graphs_compiled()
        compiled = [first]
        for per_row in ROUTINGS[1:]:
            with loras.rows(per_row):
                compiled.append(WAN.run(model, inputs))
        assert blocks.graphs_compiled() == graphs, "a new routing recompiled the blocks"
        for want, got in zip(eager, compiled):
            assert (want - got).abs().max() <= 1e-5
    finally:
        blocks.remove()
        streamer.remove()
        loras.close()
