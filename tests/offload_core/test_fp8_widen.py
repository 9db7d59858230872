"""The layer-at-once FP8 widen: bit for bit the per-tensor widen, with launches that do not grow per tensor."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from offload_core.fp8_widen import WidenMode, fused_operands, widen_groups, widen_layer, widen_plan
from offload_core.host.tier import HostingTier
from offload_core.layout import FP8_HOST_DTYPE, tensor_view
from offload_core.quant import WeightFormat, layer_layout, widen_fp8
from offload_core.streaming.host_layer import HostLayer, _fp8_views
from testing.dispatch import count_launches


class Block(nn.Module):
    """``same`` linears of one shape, one of another, a norm (kept) and biases (kept)."""

    def __init__(self, same: int, dtype: torch.dtype, scale: float = 1.0):
        super().__init__()
        self.norm = nn.LayerNorm(64)
        self.same = nn.ModuleList(nn.Linear(64, 64) for _ in range(same))
        self.up = nn.Linear(64, 96)
        self.conv = nn.Conv1d(64, 32, 3)
        with torch.no_grad():
            for p in self.parameters():
                p.mul_(scale)
        self.to(dtype)


def _hosted(block: nn.Module) -> HostLayer:
    layout = layer_layout("blocks.0", block, WeightFormat.FP8)
    params = [dict(block.named_parameters())[meta.name] for meta in layout.tensors]
    return HostLayer.consolidate(layout, [p.data for p in params], HostingTier.PAGEABLE, torch.device("cpu"))


def _regions(host: HostLayer) -> dict[torch.dtype, torch.Tensor]:
    """Device-like regions with the FP8 buffer landed in the landing region (uint8 per dtype)."""
    regions = {dtype: torch.full((n,), 0xAB, dtype=torch.uint8) for dtype, n in host.layout.flat_bytes}
    regions[FP8_HOST_DTYPE] = torch.zeros(host.layout.landing_bytes, dtype=torch.uint8)
    host.copy_host_bytes(regions)
    return regions


def _per_tensor(host: HostLayer, regions) -> None:
    """The widen as it was: quant.widen_fp8 tensor by tensor (the reference's own function)."""
    for at in host.layout.quantized:
        meta = host.layout.tensors[at.index]
        q, scale = _fp8_views(regions[FP8_HOST_DTYPE], meta, at)
        widen_fp8(q, scale, tensor_view(regions[meta.dtype], meta))


def _tensors(host: HostLayer, regions) -> list[torch.Tensor]:
    return [tensor_view(regions[meta.dtype], meta) for meta in host.layout.tensors]


# Layer-wide (eager: one conversion per run, one multiply per group) and the fused widen in its eager
# form (value x scale in float32, rounded once: the formulation torch.compile fuses into one pass).
FORMS = {"layer": widen_layer, "fused_form": lambda plan, regions: widen_groups(*fused_operands(plan, regions))}


# fp16 at 1e-4: weights of ~1e-6, whose scales (2**-28 ...) are below fp16's range: multiplied in float32
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("dtype,scale", [(torch.float32, 1.0), (torch.bfloat16, 1.0), (torch.float16, 1.0),
                                         (torch.float16, 1e-4)])
def test_the_layer_widen_equals_the_per_tensor_widen_bit_for_bit(dtype, scale, form):
    torch.manual_seed(0)
    host = _hosted(Block(5, dtype, scale))
    whole, reference = _regions(host), _regions(host)
    FORMS[form](widen_plan(host.layout), whole)
    _per_tensor(host, reference)
    for got, want in zip(_tensors(host, whole), _tensors(host, reference)):
        assert torch.equal(got.view(torch.uint8) if got.dtype.itemsize == 1 else got, want)
    # and the host's own views (what the reference model is made of) agree with both
    for got, want in zip(_tensors(host, whole), host.host_views()):
        assert torch.equal(got, want)


def test_same_shaped_tensors_form_one_group_and_launches_do_not_grow_with_them():
    counts = {}
    for same in (2, 8):
        host = _hosted(Block(same, torch.bfloat16))
        plan = widen_plan(host.layout)
        assert len(plan.runs) == 1, "one bf16 run"
        assert len(plan.groups) == 3, "the same-shaped linears, the up projection, the conv"
        assert [g.count for g in plan.groups if (g.rows, g.cols) == (64, 64)] == [same]
        regions = _regions(host)
        counts[same] = (count_launches(lambda: widen_layer(widen_plan(host.layout), regions)).launches,
                        count_launches(lambda: _per_tensor(host, regions)).launches)
    (layer_2, tensor_2), (layer_8, tensor_8) = counts[2], counts[8]
    assert layer_8 == layer_2, counts
    assert tensor_8 - tensor_2 >= 6 * 4, f"the per-tensor widen pays ~5 launches per tensor: {counts}"
    assert layer_8 * 3 < tensor_8, counts


def test_on_a_gpu_like_device_the_widen_launches_one_kernel_per_run_and_group():
    host = _hosted(Block(8, torch.bfloat16))
    plan = widen_plan(host.layout)
    regions = {dtype: torch.empty(n, dtype=torch.uint8, device="meta") for dtype, n in host.layout.flat_bytes}
    regions[FP8_HOST_DTYPE] = torch.empty(host.layout.landing_bytes, dtype=torch.uint8, device="meta")
    counter = count_launches(lambda: widen_layer(widen_plan(host.layout), regions))
    assert counter.launches == plan.launches == 1 + 3, counter.ops  # no device read to decide a scale's dtype


def test_the_fp8_buffer_mirrors_the_device_run_and_its_pieces_do_not_overlap():
    host = _hosted(Block(3, torch.bfloat16))
    layout = host.layout
    spans = []
    for at in layout.quantized:
        meta = layout.tensors[at.index]
        spans += [(at.q_offset, at.q_offset + meta.extent), (at.scale_offset, at.scale_offset + at.rows * 4)]
    spans.sort()
    assert all(a1 <= b0 for (_, a1), (b0, _) in zip(spans, spans[1:])), spans
    assert spans[-1][1] <= layout.landing_bytes


def test_the_compiled_fused_widen_equals_the_per_tensor_widen_bit_for_bit_in_any_slot():
    """Compiled once: a layer landing in another slot (other storage offsets) reuses the graph."""
    from compat.torch import compiled_graph_count

    torch.manual_seed(0)
    host = _hosted(Block(5, torch.bfloat16))
    reference = _regions(host)
    _per_tensor(host, reference)
    plan, before = widen_plan(host.layout), compiled_graph_count()
    for shift in (0, 1024, 4096):  # a slot elsewhere in one device window
        window = {dtype: torch.full((n + shift,), 0xAB, dtype=torch.uint8)[shift:]
                  for dtype, n in host.layout.flat_bytes}
        window[FP8_HOST_DTYPE] = torch.zeros(host.layout.landing_bytes + shift, dtype=torch.uint8)[shift:]
        host.copy_host_bytes(window)
        widen_layer(plan, window, WidenMode.FUSED)
        for got, want in zip(_tensors(host, window), _tensors(host, reference)):
            assert torch.equal(got, want)
    assert compiled_graph_count() - before == 1
