"""Real-size models on the meta device: published parameter counts and dtypes, nothing allocated."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch import nn

from offload_core.planner.real_models import (
    UnknownModel,
    component_spec,
    meta_component,
    model_names,
    pipeline_defaults,
)

# Published sizes (model cards / config.json); ours must match within 3%.
PUBLISHED = [
    ("wan2.1-t2v-14b", "transformer", 14.0e9),
    ("wan2.1-t2v-1.3b", "transformer", 1.42e9),
    ("wan2.1-t2v-1.3b", "text_encoder", 5.7e9),  # umT5-XXL encoder
    ("flux.1-dev", "transformer", 11.9e9),
    ("flux.1-dev", "text_encoder_2", 4.76e9),  # T5-XXL encoder
    ("flux.1-dev", "text_encoder", 123e6),  # CLIP-L text model
    ("wan2.2-t2v-a14b", "transformer", 14.0e9),  # each expert of the 27B (14B active) mixture
    ("wan2.2-t2v-a14b", "transformer_2", 14.0e9),
    ("wan2.2-ti2v-5b", "transformer", 5.0e9),  # "TI2V-5B is a 5B dense model" (Wan2.2 README)
    ("wan2.2-i2v-a14b", "transformer", 14.0e9),  # each expert: T2V-A14B's with 36 input channels
    ("wan2.2-i2v-a14b", "transformer_2", 14.0e9),
]


def _count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


@pytest.mark.parametrize("model_name,component,published", PUBLISHED)
def test_meta_components_have_the_published_parameter_counts_and_allocate_nothing(model_name, component, published):
    module = meta_component(model_name, component)
    assert abs(_count(module) - published) / published < 0.03
    assert all(t.device.type == "meta" for t in module.state_dict().values())


def test_umt5_xxl_token_table_is_256384_by_4096_fp32():
    table = meta_component("wan2.1-t2v-14b", "text_encoder").get_input_embeddings().weight
    assert table.shape == (256384, 4096) and table.dtype == torch.float32
    assert table.numel() * table.element_size() == 256384 * 4096 * 4  # 3.91 GiB


def test_components_get_their_published_dtypes():
    flux = meta_component("flux.1-dev", "transformer")
    assert {p.dtype for p in flux.parameters()} == {torch.bfloat16}
    wan = meta_component("wan2.1-t2v-1.3b", "transformer")
    # diffusers keeps Wan's norms, rope and scale-shift tables in fp32 when loading in bf16.
    assert wan.blocks[0].attn1.to_q.weight.dtype == torch.bfloat16
    assert wan.blocks[0].norm2.weight.dtype == torch.float32
    assert wan.scale_shift_table.dtype == torch.float32
    assert {p.dtype for p in meta_component("wan2.1-t2v-1.3b", "text_encoder").parameters()} == {torch.float32}


def test_same_as_inherits_the_base_and_applies_the_transformer_overrides():
    big = component_spec("wan2.1-t2v-14b", "transformer")
    small = component_spec("wan2.1-t2v-1.3b", "transformer")
    assert (big.config["num_layers"], big.config["num_attention_heads"], big.config["ffn_dim"]) == (40, 40, 13824)
    assert small.config["num_layers"] == 30, "overrides must not leak into the base model"
    assert {k: v for k, v in big.config.items() if k not in ("num_layers", "num_attention_heads", "ffn_dim")} == {
        k: v for k, v in small.config.items() if k not in ("num_layers", "num_attention_heads", "ffn_dim")
    }
    assert component_spec("wan2.1-t2v-14b", "vae") == replace(component_spec("wan2.1-t2v-1.3b", "vae"),
                                                               model_name="wan2.1-t2v-14b")
    assert len(meta_component("wan2.1-t2v-14b", "transformer").blocks) == 40
    assert pipeline_defaults("wan2.1-t2v-14b") == pipeline_defaults("wan2.1-t2v-1.3b")


@pytest.mark.parametrize("model_name", ["wan2.1-t2v-1.3b", "flux.1-dev"])
def test_declared_layer_groups_are_module_lists_of_the_meta_model(model_name):
    for component in ("transformer", "text_encoder"):
        spec = component_spec(model_name, component)
        if not spec.layer_groups:
            continue
        module = meta_component(model_name, component)
        for group in spec.layer_groups:
            assert isinstance(module.get_submodule(group), nn.ModuleList)


def test_unknown_names_raise_a_typed_error_that_lists_the_choices():
    assert set(model_names()) == {"wan2.1-t2v-1.3b", "wan2.1-t2v-14b", "flux.1-dev", "wan2.2-t2v-a14b", "sd3.5-large",
                                  "z-image-turbo", "qwen-image", "hunyuanvideo-1.5-480p-t2v", "hunyuanvideo-1.5-480p-i2v", "flux.1-kontext-dev",
                                  "qwen-image-edit-2509", "qwen-image-edit",
                                  "wan2.2-ti2v-5b", "wan2.2-i2v-a14b", "wan2.1-i2v-14b-480p"}
    with pytest.raises(UnknownModel, match="wan2.1-t2v-1.3b"):
        meta_component("wan2.2", "transformer")
    with pytest.raises(UnknownModel, match="transformer, text_encoder, vae"):
        meta_component("wan2.1-t2v-1.3b", "text_encoder_2")


def test_pipeline_defaults_are_the_published_ones():
    assert pipeline_defaults("flux.1-dev")["num_inference_steps"] == 28
