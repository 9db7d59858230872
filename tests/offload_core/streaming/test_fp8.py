"""FP8 host weights: the streamed model equals the fake-quantized plain model bit for bit, hosted and copied 8-bit."""
from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

from offload_core.buffers import LANDING_BUFFERS
from offload_core.fp8_widen import WidenMode
from offload_core.host.tier import HostingTier
from offload_core.layout import FP8_HOST_DTYPE, align_up, declared_layer_groups, resolve_layer_group
from offload_core.quant import (
    WeightFormat,
    dequantize_fp8,
    fake_quantize_,
    layer_layout,
    quantize_fp8,
    quantized_names,
)
from offload_core.streaming.engine import StreamingConfig, apply_layer_streaming
from tests.offload_core.tiny_models import ALL_CASES, FLUX, WAN, TinyCase


def _bf16(case: TinyCase) -> TinyCase:
    """The case in bf16, the real models' dtype (the tiny zoo builds fp32)."""
    def inputs():
        return {k: v.to(torch.bfloat16) if v.is_floating_point() and k not in ("timestep", "img_ids", "txt_ids") else v
                for k, v in case.inputs().items()}
    return dataclasses.replace(case, name=f"{case.name}_bf16", build=lambda: case.build().to(torch.bfloat16),
                               inputs=inputs)


CASES = (*ALL_CASES, _bf16(WAN), _bf16(FLUX))


def _layers(model):
    return [layer for group in declared_layer_groups(model) for layer in resolve_layer_group(model, group).layers]


def _reference(case: TinyCase, inputs: dict) -> torch.Tensor:
    """The plain model whose quantizable weights went through quantize -> widen."""
    model = case.build()
    fake_quantize_(_layers(model))
    return case.run(model, inputs)


def _fp8_config(model, tier: HostingTier | None, **fields) -> StreamingConfig:
    keys = [f"{group}.{i}" for group in declared_layer_groups(model)
            for i, _ in enumerate(resolve_layer_group(model, group).layers)]
    hosting = {key: tier for key in keys} if tier is not None else None
    return StreamingConfig(weights=WeightFormat.FP8, hosting=hosting, **fields)


@pytest.mark.parametrize("resident,staged", [(0, True), (1, False), (1, True)],
                         ids=["staged", "resident1_driver_copy", "resident1_staged"])
@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize("tier", [HostingTier.PINNED, HostingTier.PAGEABLE], ids=lambda t: t.value)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_streamed_fp8_model_is_bitwise_the_fake_quantized_plain_model(case, tier, depth, resident, staged,
                                                                      remove_after):
    inputs = case.inputs()
    expected = _reference(case, inputs)
    model = case.build()
    streamer = remove_after(apply_layer_streaming(
        model, "cpu", _fp8_config(model, tier, prefetch_depth=depth, resident=resident, staged_copies=staged)))
    first = case.run(model, inputs)
    streamer.finish_use()
    second = case.run(model, inputs)  # the second use copies into slots and landing buffer already used
    streamer.finish_use()
    assert torch.equal(first, expected)
    assert torch.equal(second, expected)
    assert streamer.meter.peak_bytes == streamer.predicted_peak_bytes()
    assert streamer.meter.current_bytes == streamer.non_layer_bytes


@pytest.mark.parametrize("case", [WAN, _bf16(WAN), _bf16(FLUX)], ids=lambda c: c.name)
def test_the_fused_widen_streams_bitwise_the_fake_quantized_plain_model(case, remove_after):
    """One compiled pass per group (WidenMode.FUSED) through every widen site: a resident layer copied
    directly, a resident layer staged, streamed layers through the ring; twice (slots reused)."""
    inputs = case.inputs()
    expected = _reference(case, inputs)
    for staged in (False, True):
        model = case.build()
        streamer = remove_after(apply_layer_streaming(model, "cpu", _fp8_config(
            model, HostingTier.PAGEABLE, resident=1, staged_copies=staged, widen=WidenMode.FUSED)))
        for _ in range(2):
            assert torch.equal(case.run(model, inputs), expected)
            streamer.finish_use()
        assert streamer.ring.widen_mode is streamer.resident.widen_mode is WidenMode.FUSED


def test_switching_to_the_fused_widen_rebinds_the_places_the_ring_already_made(remove_after, monkeypatch):
    """Block compile switches a streamer that already ran: its ring's places, bound eager, are made again."""
    from offload_core import fp8_widen

    inputs = WAN.inputs()
    expected = _reference(WAN, inputs)
    model = WAN.build()
    streamer = remove_after(apply_layer_streaming(model, "cpu", _fp8_config(model, HostingTier.PINNED)))
    assert torch.equal(WAN.run(model, inputs), expected)  # the places are made, bound eager
    streamer.finish_use()
    kernel, calls = fp8_widen._fused_kernel(), []
    monkeypatch.setattr(fp8_widen, "_fused_kernel", lambda: lambda *args: (calls.append(1), kernel(*args)))
    streamer.set_widen(WidenMode.FUSED)
    assert torch.equal(WAN.run(model, inputs), expected)
    streamer.finish_use()
    assert len(calls) >= len(streamer.layers), "every streamed layer's copy widened fused"


def test_fused_widen_where_it_cannot_compile_stays_eager_and_says_why(remove_after, monkeypatch, caplog):
    from offload_core import fp8_widen

    monkeypatch.setattr(fp8_widen.torch.cuda, "get_device_capability", lambda device: (8, 0))
    assert fp8_widen.fused_refusal(torch.device("cuda", 0)) == (
        "Triton converts float8_e4m3fn from compute capability 8.9 on; cuda:0 is 8.0")
    monkeypatch.setattr(fp8_widen.torch.cuda, "get_device_capability", lambda device: (9, 0))
    assert fp8_widen.fused_refusal(torch.device("cuda", 0)) is None
    monkeypatch.setattr(fp8_widen.shutil, "which", lambda name: None)
    monkeypatch.delenv("CXX", raising=False)
    refusal = fp8_widen.fused_refusal(torch.device("cpu"))
    assert refusal is not None and "no C++ compiler" in refusal
    model = WAN.build()
    with caplog.at_level(logging.INFO, logger="offload_core.streaming.engine"):
        streamer = remove_after(apply_layer_streaming(model, "cpu", _fp8_config(
            model, HostingTier.PINNED, widen=WidenMode.FUSED)))
    assert streamer.widen_mode is WidenMode.EAGER
    assert "FP8 widen stays eager, not fused: inductor's CPU backend compiles C++" in caplog.text
    inputs = WAN.inputs()
    assert torch.equal(WAN.run(model, inputs), _reference(WAN, inputs))


def test_widen_must_be_a_widen_mode():
    with pytest.raises(TypeError, match=r"widen must be a WidenMode \(\['eager', 'fused'\]\), got 'fused'"):
        StreamingConfig(widen="fused")


@pytest.mark.parametrize("case", [WAN, FLUX, _bf16(WAN)], ids=lambda c: c.name)
def test_layers_are_hosted_and_copied_at_their_8bit_size(case, remove_after):
    model = case.build()
    streamer = remove_after(apply_layer_streaming(model, "cpu", _fp8_config(model, HostingTier.PINNED)))
    native = sum(layer.nbytes for layer in streamer.layers)
    hosted = sum(layer.host.nbytes for layer in streamer.layers)
    assert hosted == streamer.host_layer_bytes == sum(layer.layout.host_nbytes for layer in streamer.layers)
    assert hosted < native
    for layer in streamer.layers:  # every quantized tensor is one byte per element on the host
        fp8 = dict(layer.layout.host_flat_bytes)[FP8_HOST_DTYPE]
        elements = sum(layer.layout.tensors[q.index].extent for q in layer.layout.quantized)
        assert elements <= fp8 < elements + len(layer.layout.quantized) * 2 * 64 + 512 + 4 * sum(
            q.rows for q in layer.layout.quantized)
    streamer.reset_counters()
    streamer.prepare_for_use()  # as a request does: the plan's copies are counted from it
    case.run(model, case.inputs())
    streamer.finish_use()
    n, slots = len(streamer.layers), streamer.ring.n_slots
    # One use copies every layer once, and the exits prefetch the layers the window holds from the
    # first (wrapped; placed by their device bytes, copied at their 8-bit size).
    wrapped = streamer.ring.copies_per_request(1) - n
    assert wrapped >= 1 and streamer.bytes_copied == hosted + sum(
        layer.layout.host_nbytes for layer in streamer.layers[:wrapped])
    assert n > slots


def test_landing_buffers_are_two_of_the_largest_fp8_buffer_and_counted_in_the_peak(remove_after):
    model = FLUX.build()
    streamer = remove_after(apply_layer_streaming(model, "cpu", _fp8_config(model, None, prefetch_depth=1)))
    largest = max(dict(layer.layout.host_flat_bytes)[FP8_HOST_DTYPE] for layer in streamer.layers)
    assert streamer.ring.landing_bytes == LANDING_BUFFERS * align_up(largest) == 2 * largest
    assert streamer.predicted_peak_bytes() == (streamer.non_layer_bytes + streamer.ring.slot_bytes + 2 * largest)
    FLUX.run(model, FLUX.inputs())
    assert streamer.meter.peak_bytes == streamer.predicted_peak_bytes()
    streamer.finish_use()
    assert streamer.meter.current_bytes == streamer.non_layer_bytes, "the landing buffer leaves with the slots"


def test_only_linear_and_conv_weights_are_quantized_tables_norms_biases_stay():
    model = WAN.build()
    block = model.blocks[0]
    names = quantized_names(block, WeightFormat.FP8)
    assert names and all(name.endswith(".weight") for name in names)
    kept = {name for name, _ in block.named_parameters()} - names
    assert "scale_shift_table" in kept  # a modulation table: rows read, not reduced
    assert any("norm" in name for name in kept) and any(name.endswith(".bias") for name in kept)
    assert quantized_names(block, WeightFormat.NATIVE) == frozenset()
    layout = layer_layout("blocks.0", block, WeightFormat.FP8)
    assert {layout.tensors[q.index].name for q in layout.quantized} == names


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_quantize_is_deterministic_exact_to_widen_and_a_fixed_point(dtype):
    g = torch.Generator().manual_seed(3)
    weight = (torch.randn(64, 48, generator=g) * torch.rand(64, 1, generator=g) * 3).to(dtype)
    weight[5] = 0  # a row of zeros gets scale 1, never 0/0
    q1, s1 = quantize_fp8(weight)
    q2, s2 = quantize_fp8(weight.clone())
    assert torch.equal(q1.view(torch.uint8), q2.view(torch.uint8)) and torch.equal(s1, s2)
    assert q1.dtype is torch.float8_e4m3fn and s1.dtype is torch.float32 and s1[5] == 1
    assert torch.equal(torch.frexp(s1).mantissa, torch.full_like(s1, 0.5)), "power-of-two scales"
    rows = weight.float().abs().amax(dim=1)[torch.arange(64) != 5] / s1[torch.arange(64) != 5]
    assert bool(((rows > 224) & (rows <= 448)).all()), "each row's maximum lands in e4m3's top binade"
    widened = dequantize_fp8(q1, s1, dtype)
    assert torch.equal(widened.double(), q1.double() * s1.double()[:, None]), "the widen rounds nothing"
    assert torch.equal(dequantize_fp8(*quantize_fp8(widened), dtype), widened), "re-quantizing changes nothing"
    assert (widened.float() - weight.float()).abs().max() <= weight.float().abs().max() / 16  # e4m3: 3 mantissa bits


def test_mapped_fp8_layers_are_quantized_once_into_pageable_memory_and_stream_bitwise(remove_after, caplog):
    model, inputs = WAN.build(), WAN.inputs()
    expected = _reference(WAN, inputs)
    with caplog.at_level(logging.INFO, logger="offload_core.streaming.host_layer"):
        streamer = remove_after(apply_layer_streaming(model, "cpu", _fp8_config(model, HostingTier.MAPPED)))
    assert {layer.host.tier for layer in streamer.layers} == {HostingTier.PAGEABLE}
    assert all(layer.host.nbytes >= layer.layout.host_nbytes for layer in streamer.layers), "the 8-bit copy is held"
    assert "planned MAPPED with FP8 weights: quantized once" in caplog.text
    assert torch.equal(WAN.run(model, inputs), expected)


def test_remove_gives_back_the_widened_weights_and_streaming_again_computes_the_same(remove_after):
    model = WAN.build()
    reference = WAN.build()
    fake_quantize_(_layers(reference))
    streamer = apply_layer_streaming(model, "cpu", _fp8_config(model, HostingTier.PINNED))
    streamer.remove()
    for (name, mine), (_, theirs) in zip(model.named_parameters(), reference.named_parameters()):
        assert torch.equal(mine, theirs), name
    # A replica re-applies its plan after the warm-up: the widened weights are quantized again.
    remove_after(apply_layer_streaming(model, "cpu", _fp8_config(model, HostingTier.PAGEABLE)))
    inputs = WAN.inputs()
    assert torch.equal(WAN.run(model, inputs), WAN.run(reference, inputs))


def test_weights_must_be_a_weight_format():
    with pytest.raises(TypeError, match="weights"):
        StreamingConfig(weights="fp8")
    assert WeightFormat.parse("fp8") is WeightFormat.FP8 and WeightFormat.parse(None) is WeightFormat.NATIVE
    with pytest.raises(ValueError, match="weights must be one of"):
        WeightFormat.parse("int4")
