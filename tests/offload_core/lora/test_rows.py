"""One forward, three rows, three choices [X, None, Y]: each row gets what its adapter gives alone, and the row
without one gets the base model's output bit for bit; outside rows() and for flattened batches as documented."""
from __future__ import annotations

import pytest
import torch

from offload_core.lora import LoraError, apply_lora, load_lora
from offload_core.streaming.engine import apply_layer_streaming
from tests.offload_core.lora.adapters import random_weights, save_diffusers
from tests.offload_core.tiny_models import FLUX, WAN, TinyCase

TOLERANCE = 1e-5
BATCHED = {"hidden_states", "encoder_hidden_states", "pooled_projections", "timestep"}


def _batch(case: TinyCase, n: int) -> dict:
    """``n`` different rows (seeded noise per row), the ids shared as the pipelines share them."""
    one = case.inputs()
    generator = torch.Generator().manual_seed(7)
    batch = {}
    for key, value in one.items():
        if key not in BATCHED:
            batch[key] = value
        elif key == "timestep":
            batch[key] = value.repeat(n)
        else:
            batch[key] = torch.randn((n, *value.shape[1:]), generator=generator)
    return batch


def _row(inputs: dict, i: int) -> dict:
    return {k: v[i:i + 1] if k in BATCHED else v for k, v in inputs.items()}


@pytest.fixture(params=[WAN, FLUX], ids=lambda c: c.name)
def streamed(request, tmp_path):
    """(case, model streamed with a LoraSet holding X and Y, the plain model)."""
    case = request.param
    model = case.build()
    loras = apply_lora(model, "cpu", budget_bytes=1 << 24)
    for seed, name in ((1, "x"), (2, "y")):
        path = save_diffusers(random_weights(model, rank=4, seed=seed), tmp_path / f"{name}.safetensors")
        loras.load(load_lora(path, name))
    streamer = apply_layer_streaming(model, "cpu")
    yield case, model, loras
    streamer.remove()
    loras.close()


def test_each_row_gets_its_own_adapter_and_a_row_without_one_the_base_output_bitwise(streamed):
    case, model, loras = streamed
    inputs = _batch(case, 3)
    base = case.run(model, inputs)
    with loras.rows([("x", 0.8), None, ("y", 1.3)]):
        mixed = case.run(model, inputs)
    alone = []
    for i, choice in enumerate([("x", 0.8), None, ("y", 1.3)]):
        with loras.rows([choice]):
            alone.append(case.run(model, _row(inputs, i)))
    assert torch.equal(mixed[1], base[1])  # no adapter: the base output of the same batch, bit for bit
    for i in (0, 2):
        assert (mixed[i] - base[i]).abs().max() > 100 * TOLERANCE  # each adapter moves its row
        assert (mixed[i] - alone[i][0]).abs().max() <= TOLERANCE, i
    assert (alone[1][0] - base[1]).abs().max() <= TOLERANCE
    assert torch.equal(case.run(model, inputs), base)  # after rows(): as without LoRA


def test_two_rows_with_one_adapter_at_two_scales_each_get_their_scale(streamed):
    case, model, loras = streamed
    inputs = _batch(case, 2)
    with loras.rows([("x", 0.5), ("x", 2.0)]):
        mixed = case.run(model, inputs)
    for i, scale in enumerate((0.5, 2.0)):
        with loras.rows([("x", scale)]):
            assert (mixed[i] - case.run(model, _row(inputs, i))[0]).abs().max() <= TOLERANCE


def test_routing_names_rows_only_of_this_forward(streamed):
    case, model, loras = streamed
    with pytest.raises(LoraError, match="'z' is not loaded"):
        with loras.rows([("z", 1.0)]):
            pass
    with pytest.raises(LoraError, match="batch rows first"):  # 2 routed rows, a forward of 3
        with loras.rows([("x", 1.0), None]):
            case.run(model, _batch(case, 3))
    with pytest.raises(LoraError, match="already active"):
        with loras.rows([None]), loras.rows([None]):
            pass
    base = case.run(model, _batch(case, 2))
    with loras.rows([]):  # no rows routed, no input checked: the base model
        assert torch.equal(case.run(model, _batch(case, 2)), base)


class _Flat(torch.nn.Module):
    """A Linear fed a row-major flattened batch ([B * k, in]), as Wan 2.2's per-token timestep embedder is."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.linear = torch.nn.Linear(8, 8)

    def forward(self, x):  # x: [B, k, 8]
        return self.linear(x.flatten(0, 1)).unflatten(0, x.shape[:2])


def test_a_flattened_batch_routes_each_batch_rows_block(tmp_path):
    model = _Flat()
    path = save_diffusers(random_weights(model, modules=["linear"], seed=4), tmp_path / "f.safetensors")
    loras = apply_lora(model, "cpu", budget_bytes=1 << 20)
    loras.load(load_lora(path, "f"))
    x = torch.randn(3, 5, 8)
    with torch.no_grad():
        base = model(x)
        with loras.rows([None, ("f", 1.0), None]):
            mixed = model(x)
        with loras.rows([("f", 1.0)]):
            alone = model(x[1:2])
    assert torch.equal(mixed[0], base[0]) and torch.equal(mixed[2], base[2])
    assert (mixed[1] - alone[0]).abs().max() <= TOLERANCE and (mixed[1] - base[1]).abs().max() > 0.01
