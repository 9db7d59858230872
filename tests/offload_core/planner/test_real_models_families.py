"""The newer families at real size on the meta device: SD3.5 Large, Z-Image Turbo, Qwen-Image and
HunyuanVideo 1.5 match their published sizes (the sources in configs/models/real_model_configs.json)."""
from __future__ import annotations

import pytest
from torch import nn

from offload_core.planner.real_models import component_names, meta_component, pipeline_class

GiB = 1024**3
# (model, component, published parameters): model cards and repository file sizes; ours within 3%.
PUBLISHED = [
    ("sd3.5-large", "transformer", 8.1e9),  # "SD 3.5 Large - 8.1B"
    ("sd3.5-large", "text_encoder_3", 4.7e9),  # T5-XXL encoder, "4.7B parameters" (diffusers' SD3 docs)
    ("z-image-turbo", "transformer", 6.0e9),  # "a 6B-parameter model"
    ("qwen-image", "transformer", 20.43e9),  # 20,430,401,088 counted for the same DiT (Qwen-Image-Edit)
    ("hunyuanvideo-1.5-480p-t2v", "transformer", 8.3e9),  # "DiT has 8.3B parameters"
]
# Qwen-Image's bf16 weight sizes per component as published for its diffusers repo.
QWEN_IMAGE_GIB = {"text_encoder": 15.45, "transformer": 38.06, "vae": 0.24}


def _bytes(module: nn.Module, buffers: bool = False) -> int:
    tensors = [*module.parameters(), *(module.buffers() if buffers else ())]
    return sum(t.numel() * t.element_size() for t in tensors)


@pytest.mark.parametrize("model_name,component,published", PUBLISHED)
def test_the_new_families_have_their_published_parameter_counts(model_name, component, published):
    module = meta_component(model_name, component)
    assert abs(sum(p.numel() for p in module.parameters()) - published) / published < 0.03
    assert all(t.device.type == "meta" for t in module.state_dict().values())


def test_sd35_large_transformer_is_byte_for_byte_its_safetensors_index():
    # transformer/diffusion_pytorch_model.safetensors.index.json metadata.total_size; the file holds
    # the 192 x 192 position table too, which diffusers keeps as a buffer.
    assert _bytes(meta_component("sd3.5-large", "transformer"), buffers=True) == 16_292_561_536


def test_qwen_image_components_have_the_published_weight_sizes():
    for component, gib in QWEN_IMAGE_GIB.items():
        assert abs(_bytes(meta_component("qwen-image", component)) / GiB - gib) < 0.01 * gib + 0.005, component


def test_each_new_family_names_its_pipeline_and_every_component_the_planner_stages():
    from offload_core.planner.inputs import STAGES

    expected = {"sd3.5-large": "StableDiffusion3Pipeline", "z-image-turbo": "ZImagePipeline",
                "qwen-image": "QwenImagePipeline", "hunyuanvideo-1.5-480p-t2v": "HunyuanVideo15Pipeline"}
    for model_name, pipeline in expected.items():
        assert pipeline_class(model_name) == pipeline
        staged = sorted(c for stage in STAGES[pipeline] for c in stage.components)
        assert staged == sorted(component_names(model_name))


def _parameters(model_name: str, component: str) -> int:
    return sum(p.numel() for p in meta_component(model_name, component).parameters())


def test_wan21_i2v_is_the_t2v_14b_plus_its_image_conditioning_and_a_vit_h_image_encoder():
    from offload_core.planner.inputs import pipeline_stages

    # Per block: image key and value projections (5120 x 5120 + bias) and the key's RMSNorm; 20 more input
    # channels in the 1x2x2 patch embedding; the image embedder (LayerNorm 1280, 1280 -> 1280 -> 5120, LayerNorm 5120).
    image = 40 * (2 * (5120 * 5120 + 5120) + 5120) + 20 * 4 * 5120 + (2 * 1280 + 1280 * 1281 + 5120 * 1281 + 2 * 5120)
    assert _parameters("wan2.1-i2v-14b-480p", "transformer") == _parameters("wan2.1-t2v-14b", "transformer") + image
    # OpenCLIP ViT-H/14's vision tower: 632M parameters.
    assert abs(_parameters("wan2.1-i2v-14b-480p", "image_encoder") - 632e6) / 632e6 < 0.03
    stages = pipeline_stages(pipeline_class("wan2.1-i2v-14b-480p"), component_names("wan2.1-i2v-14b-480p"))
    assert [s.components for s in stages] == [("text_encoder", "image_encoder"), ("transformer",), ("vae",)]
