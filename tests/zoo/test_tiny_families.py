"""The newer families' tiny folders load with their real diffusers pipelines, keep the real folders'
component layout, and generate deterministically from a seed (and depend on the prompt)."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from diffusers import HunyuanVideo15Pipeline, QwenImagePipeline, StableDiffusion3Pipeline, ZImagePipeline
from safetensors import safe_open

from zoo.tiny_families import (
    T5_XXL_VOCAB_ROWS,
    ensure_tiny_hunyuan15,
    ensure_tiny_qwen_image,
    ensure_tiny_sd3,
    ensure_tiny_zimage,
)
from zoo.vocab_qwen import qwen_tokenizer

# model_index.json component classes of the real folders (configs/models/real_model_configs.json's sources:
# stabilityai/stable-diffusion-3.5-large, Tongyi-MAI/Z-Image-Turbo, Qwen/Qwen-Image,
# hunyuanvideo-community/HunyuanVideo-1.5-Diffusers-480p_t2v); tokenizers may be the fast or slow class.
REAL_LAYOUT = {
    "sd3": ("StableDiffusion3Pipeline", {
        "text_encoder": "CLIPTextModelWithProjection", "text_encoder_2": "CLIPTextModelWithProjection",
        "text_encoder_3": "T5EncoderModel", "transformer": "SD3Transformer2DModel", "vae": "AutoencoderKL",
        "scheduler": "FlowMatchEulerDiscreteScheduler"}),
    "zimage": ("ZImagePipeline", {
        "text_encoder": "Qwen3Model", "transformer": "ZImageTransformer2DModel", "vae": "AutoencoderKL",
        "scheduler": "FlowMatchEulerDiscreteScheduler"}),
    "qwen-image": ("QwenImagePipeline", {
        "text_encoder": "Qwen2_5_VLForConditionalGeneration", "transformer": "QwenImageTransformer2DModel",
        "vae": "AutoencoderKLQwenImage", "scheduler": "FlowMatchEulerDiscreteScheduler"}),
    "hunyuan15": ("HunyuanVideo15Pipeline", {
        "text_encoder": "Qwen2_5_VLTextModel", "text_encoder_2": "T5EncoderModel",
        "transformer": "HunyuanVideo15Transformer3DModel", "vae": "AutoencoderKLHunyuanVideo15",
        "scheduler": "FlowMatchEulerDiscreteScheduler", "guider": "ClassifierFreeGuidance"}),
}
FOLDERS = {"sd3": ensure_tiny_sd3, "zimage": ensure_tiny_zimage, "qwen-image": ensure_tiny_qwen_image,
           "hunyuan15": ensure_tiny_hunyuan15}
PIPELINES = {"sd3": StableDiffusion3Pipeline, "zimage": ZImagePipeline, "qwen-image": QwenImagePipeline,
             "hunyuan15": HunyuanVideo15Pipeline}


def _run(name, pipe, seed=0, prompt="a red cat riding a horse"):
    common = dict(height=32, width=32, num_inference_steps=2, generator=torch.Generator().manual_seed(seed),
                  output_type="np")
    if name == "hunyuan15":
        return pipe(prompt, num_frames=5, **common).frames
    if name == "qwen-image":
        return pipe(prompt, negative_prompt=" ", true_cfg_scale=4.0, **common).images
    return pipe(prompt, **common).images


@pytest.mark.parametrize("name", sorted(FOLDERS))
def test_each_folder_has_the_real_folders_component_layout(name):
    index = json.loads((FOLDERS[name]() / "model_index.json").read_text())
    pipeline, components = REAL_LAYOUT[name]
    assert index["_class_name"] == pipeline
    assert {k: index[k][1] for k in components} == components


@pytest.mark.parametrize("name", sorted(FOLDERS))
def test_each_family_generates_the_same_output_twice_and_another_for_another_seed_or_prompt(name):
    pipe = PIPELINES[name].from_pretrained(FOLDERS[name](), dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    first, again = _run(name, pipe), _run(name, pipe)
    assert first.shape == ((1, 5, 32, 32, 3) if name == "hunyuan15" else (1, 32, 32, 3))
    assert np.isfinite(first).all()
    assert np.array_equal(first, again), "same seed must give bitwise-equal output"
    assert not np.array_equal(first, _run(name, pipe, seed=1)), "the output must depend on the noise"
    assert not np.array_equal(first, _run(name, pipe, prompt="a blue bird")), "the output must depend on the prompt"


def test_sd3s_t5_keeps_t5_xxls_token_table_rows_on_disk():
    path = ensure_tiny_sd3() / "text_encoder_3" / "model.safetensors"
    with safe_open(str(path), framework="pt") as f:
        shapes = [f.get_slice(k).get_shape() for k in f.keys()]
    assert [T5_XXL_VOCAB_ROWS, 32] in shapes


def test_the_qwen_tokenizer_takes_any_text_without_unknowns_and_keeps_chat_markers_whole():
    tokenizer = qwen_tokenizer()
    text = "An astronaut riding a horse, 4k photo! é ☃ 猫"
    ids = tokenizer(text).input_ids
    assert tokenizer.decode(ids) == text  # byte-level: every byte has a symbol
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "a cat"}], tokenize=False,
                                         add_generation_prompt=True)
    assert chat == "<|im_start|>user\na cat<|im_end|>\n<|im_start|>assistant\n"
    marker = tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert tokenizer(chat).input_ids.count(marker) == 2
