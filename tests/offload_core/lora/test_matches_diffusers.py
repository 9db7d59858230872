"""A request's adapter applied by LoraSet equals diffusers' own load_lora_adapter + set_adapters (unfused),
whatever hosts the base weights: resident, streamed pinned or pageable, FP8 (against the fake-quantized model)."""
from __future__ import annotations

import logging

import pytest
import torch

from offload_core.host.tier import HostingTier
from offload_core.layout import declared_layer_groups, resolve_layer_group
from offload_core.lora import apply_lora, load_lora
from offload_core.quant import WeightFormat, fake_quantize_
from offload_core.streaming.engine import StreamingConfig, apply_layer_streaming
from tests.offload_core.lora.adapters import random_weights, save_diffusers, save_peft, with_diffusers_lora
from tests.offload_core.tiny_models import FLUX, WAN, TinyCase

logger = logging.getLogger(__name__)
# fp32 on CPU: the same kernels in the same order as peft's lora_B(lora_A(x)) * scaling give 0.0
# today; the bound leaves room for a BLAS that blocks the low-rank matmuls differently.
TOLERANCE = 1e-5
SCALE = 0.7


def _layers(model):
    return [layer for group in declared_layer_groups(model) for layer in resolve_layer_group(model, group).layers]


def _hosting(model, tier: HostingTier) -> dict[str, HostingTier]:
    return {f"{group}.{i}": tier for group in declared_layer_groups(model)
            for i, _ in enumerate(resolve_layer_group(model, group).layers)}


def _reference(case: TinyCase, path, inputs: dict, fp8: bool) -> torch.Tensor:
    model = case.build()
    if fp8:
        fake_quantize_(_layers(model))
    return case.run(with_diffusers_lora(model, [("x", path, SCALE)]), inputs)


def _ours(case: TinyCase, path, inputs: dict, hosting: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(with the adapter, outside rows()) from a model whose base weights are hosted as ``hosting``.

    Pinned: LoRA applied before streaming; pageable and FP8: after it (the Linears' weights are
    placeholders then: check_fits and the device copy read only shapes and dtypes)."""
    model = case.build()
    streamer = None
    if hosting == "pinned":
        loras = apply_lora(model, "cpu", budget_bytes=1 << 24)
        loras.load(load_lora(path, "x", scale=SCALE))
    if hosting != "resident":
        tier = HostingTier.PINNED if hosting == "pinned" else HostingTier.PAGEABLE
        weights = WeightFormat.FP8 if hosting == "fp8" else WeightFormat.NATIVE
        streamer = apply_layer_streaming(model, "cpu", StreamingConfig(hosting=_hosting(model, tier), weights=weights))
    if hosting != "pinned":
        loras = apply_lora(model, "cpu", budget_bytes=1 << 24)
        loras.load(load_lora(path, "x", scale=SCALE))
    try:
        with loras.rows([("x", SCALE)]):
            adapted = case.run(model, inputs)
        return adapted, case.run(model, inputs)
    finally:
        if streamer is not None:
            streamer.remove()


@pytest.mark.parametrize("hosting", ["resident", "pinned", "pageable", "fp8"])
@pytest.mark.parametrize("case", [WAN, FLUX], ids=lambda c: c.name)
def test_an_adapter_gives_what_diffusers_gives_whatever_hosts_the_base_weights(case, hosting, tmp_path):
    path = save_diffusers(random_weights(case.build(), rank=4, seed=3), tmp_path / "x.safetensors")
    inputs = case.inputs()
    want = _reference(case, path, inputs, fp8=hosting == "fp8")
    plain_model = case.build()
    if hosting == "fp8":
        fake_quantize_(_layers(plain_model))
    base = case.run(plain_model, inputs)
    got, outside = _ours(case, path, inputs, hosting)
    diff = (got - want).abs().max().item()
    logger.info("%s %s: max |ours - diffusers| = %.3g; the adapter moves the output by %.3g", case.name, hosting,
                diff, (want - base).abs().max().item())
    assert (want - base).abs().max() > 100 * TOLERANCE  # the adapter matters, far beyond the tolerance
    assert diff <= TOLERANCE
    assert torch.equal(outside, base)  # outside rows(): the model as without LoRA, bit for bit


@pytest.mark.parametrize("case", [WAN, FLUX], ids=lambda c: c.name)
def test_a_peft_folder_scales_by_alpha_over_rank_as_peft_does(case, tmp_path):
    model = case.build()
    weights = random_weights(model, rank=4, seed=5)
    folder = save_peft(weights, tmp_path / "peft", alpha=8.0)  # scaling 8 / 4 = 2
    plain = save_diffusers(weights, tmp_path / "plain.safetensors")
    adapter = load_lora(folder, "p", scale=SCALE)
    assert (adapter.rank, adapter.alpha, adapter.scaling) == (4, 8.0, 2.0)
    want = case.run(with_diffusers_lora(case.build(), [("p", plain, 2.0 * SCALE)]), case.inputs())
    loras = apply_lora(model, "cpu", budget_bytes=1 << 24)
    loras.load(adapter)
    with loras.rows([("p", SCALE)]):
        got = case.run(model, case.inputs())
    assert (got - want).abs().max() <= TOLERANCE


@pytest.mark.parametrize("case", [WAN, FLUX], ids=lambda c: c.name)
def test_in_bf16_the_adapter_is_copied_in_the_models_dtype_and_gives_what_diffusers_gives(case, tmp_path):
    """The real models' dtype: the fp32 file's A/B land as bf16, as peft casts them (0.0 apart today)."""
    path = save_diffusers(random_weights(case.build(), rank=4, seed=3), tmp_path / "x.safetensors")
    inputs = {k: v.to(torch.bfloat16) if v.is_floating_point() and k not in ("timestep", "img_ids", "txt_ids") else v
              for k, v in case.inputs().items()}
    want = case.run(with_diffusers_lora(case.build().to(torch.bfloat16), [("x", path, SCALE)]), inputs)
    model = case.build().to(torch.bfloat16)
    loras = apply_lora(model, "cpu", budget_bytes=1 << 24)
    loras.load(load_lora(path, "x"))
    streamer = apply_layer_streaming(model, "cpu", StreamingConfig(hosting=_hosting(model, HostingTier.PINNED)))
    try:
        with loras.rows([("x", SCALE)]):
            got = case.run(model, inputs)
    finally:
        streamer.remove()
    assert got.dtype == torch.bfloat16
    assert (got.float() - want.float()).abs().max() <= 1e-2 * want.float().abs().max()  # bf16: 8 bits of mantissa
