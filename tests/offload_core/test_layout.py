"""Layer groups, flat per-dtype layouts with aligned offsets, typed metadata and placeholders."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from offload_core.buffers import RegionMap
from offload_core.host.tier import HostingTier
from offload_core.layout import (
    ALIGN_BYTES,
    KNOWN_LAYER_GROUPS,
    LayoutError,
    check_disjoint,
    declared_layer_groups,
    is_placeholder,
    placeholder,
    plan_layer_layout,
    resolve_layer_group,
    storage_extent,
    tensor_view,
)
from offload_core.streaming.host_layer import HostLayer
from tests.offload_core.tiny_models import CLIP, FLUX, T5, UMT5, WAN, WAN_VAE, Stack


class MixedBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Parameter(torch.randn(3, 5))  # 60 B fp32
        self.b = nn.Parameter(torch.randn(7, dtype=torch.float16))  # 14 B fp16
        self.c = nn.Parameter(torch.randn(4, 6).t())  # non-contiguous, strides (1, 6)
        self.d = nn.Parameter(torch.randn(2, dtype=torch.float16))


def test_each_dtype_gets_one_flat_buffer_with_aligned_offsets():
    block = MixedBlock()
    layout = plan_layer_layout("blocks.0", list(block.named_parameters()))
    assert [m.name for m in layout.tensors] == ["a", "b", "c", "d"]
    offsets = {m.name: m.byte_offset for m in layout.tensors}
    assert offsets == {"a": 0, "b": 0, "c": ALIGN_BYTES, "d": ALIGN_BYTES}
    assert all(m.byte_offset % ALIGN_BYTES == 0 for m in layout.tensors)
    assert layout.flat_bytes == ((torch.float16, 2 * ALIGN_BYTES), (torch.float32, 2 * ALIGN_BYTES))
    assert layout.nbytes == 4 * ALIGN_BYTES
    assert layout.tensor_bytes == 60 + 14 + 96 + 4


def test_metadata_keeps_shape_stride_and_storage_offset():
    base = torch.arange(40, dtype=torch.float32)
    strided = base[3:].as_strided((4, 3), (1, 4), 5)  # non-contiguous, storage offset 5
    layout = plan_layer_layout("g.0", [("w", strided)])
    meta = layout.tensors[0]
    assert (meta.shape, meta.stride, meta.storage_offset) == ((4, 3), (1, 4), 5)
    assert meta.extent == storage_extent(strided) == 1 + 3 * 1 + 2 * 4
    host = HostLayer.consolidate(layout, [strided], HostingTier.PAGEABLE, torch.device("cpu"))
    rebuilt = tensor_view(host.host_tensors()[0], meta)
    assert rebuilt.stride() == (1, 4) and torch.equal(rebuilt, strided)
    assert rebuilt.untyped_storage().data_ptr() != base.untyped_storage().data_ptr()


def test_layout_can_be_planned_on_the_meta_device():
    with torch.device("meta"):
        block = MixedBlock()
    layout = plan_layer_layout("blocks.0", list(block.named_parameters()))
    assert layout.nbytes == 4 * ALIGN_BYTES
    with pytest.raises(LayoutError, match="meta device"):
        HostLayer.consolidate(layout, [p for p in block.parameters()], HostingTier.PAGEABLE, torch.device("cpu"))


def test_region_map_covers_the_largest_layer_per_dtype():
    small = plan_layer_layout("g.0", [("w", torch.zeros(10)), ("h", torch.zeros(3, dtype=torch.float16))])
    large = plan_layer_layout("g.1", [("w", torch.zeros(300))])
    regions = RegionMap.covering([small, large])
    assert regions.regions == ((torch.float16, 0, ALIGN_BYTES), (torch.float32, ALIGN_BYTES, 3 * ALIGN_BYTES))
    carved = regions.carve(torch.empty(regions.nbytes, dtype=torch.uint8))
    assert carved[torch.float32].numel() == 3 * ALIGN_BYTES
    with pytest.raises(AssertionError, match="overrun"):
        regions.carve(torch.empty(10, dtype=torch.uint8))


def test_placeholders_are_zero_element_and_shared_per_device_and_dtype():
    one = placeholder(torch.device("cpu"), torch.float32)
    assert one.numel() == 0 and one.shape == (0,) and is_placeholder(one)
    assert placeholder(torch.device("cpu"), torch.float32) is one
    assert placeholder(torch.device("cpu"), torch.float16) is not one
    with pytest.raises(RuntimeError):
        torch.randn(4, 3) * one  # a (1,) placeholder would broadcast silently here


@pytest.mark.parametrize("case,groups", [
    (WAN, ("blocks",)), (FLUX, ("transformer_blocks", "single_transformer_blocks")),
    (UMT5, ("encoder.block",)), (WAN_VAE, ("decoder.up_blocks",)), (T5, ("encoder.block",)),
    (CLIP, ("encoder.layers",)),
], ids=lambda v: getattr(v, "name", None))
def test_known_classes_declare_their_groups_in_execution_order(case, groups):
    model = case.build()
    assert declared_layer_groups(model) == groups
    assert all(len(resolve_layer_group(model, path).layers) > 0 for path in groups)


def test_a_model_may_declare_its_own_groups_and_unknown_models_are_refused():
    assert declared_layer_groups(Stack()) == ("blocks",)
    assert "CLIPTextModel" in KNOWN_LAYER_GROUPS
    with pytest.raises(LayoutError, match="declares no layer groups"):
        declared_layer_groups(nn.Linear(2, 2))


def test_a_group_path_that_does_not_exist_names_the_missing_part():
    with pytest.raises(LayoutError, match="no submodule 'encoder.blocks'"):
        resolve_layer_group(UMT5.build(), "encoder.blocks")


def test_a_group_path_that_is_not_a_module_list_is_refused():
    with pytest.raises(LayoutError, match="is a Linear, not an nn.ModuleList"):
        resolve_layer_group(Stack(), "proj_in")
    with pytest.raises(LayoutError, match="not an nn.ModuleList"):
        resolve_layer_group(Stack(), "blocks.0")


def test_a_weight_shared_between_layers_is_refused():
    shared = nn.Parameter(torch.zeros(2))
    with pytest.raises(LayoutError, match="shared by layers"):
        check_disjoint({"g.0": [shared], "g.1": [shared]}, [])
    with pytest.raises(LayoutError, match="outside the layer groups"):
        check_disjoint({"g.0": [shared]}, [shared])


def test_a_known_class_in_its_older_layout_gets_its_legacy_groups():
    class CLIPTextModel(nn.Module):  # transformers 4.x kept the layers under `text_model`
        def __init__(self):
            super().__init__()
            self.text_model = nn.Module()
            self.text_model.encoder = nn.Module()
            self.text_model.encoder.layers = nn.ModuleList([nn.Linear(2, 2)])

    assert declared_layer_groups(CLIPTextModel()) == ("text_model.encoder.layers",)
