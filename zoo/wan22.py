"""The tiny Wan2.2 zoo: the two-expert A14B, the 5B with its 48-channel VAE, and image-to-video.

Same classes, same widths and the same seeded components as ``zoo.tiny``'s Wan (the text encoder
keeps umT5's full token table), arranged as each published Wan2.2 folder is:

- ``tiny-wan22-a14b``: ``WanPipeline`` with ``transformer`` (high noise) and ``transformer_2``
  (low noise), switched at ``boundary_ratio`` 0.875 (Wan-AI/Wan2.2-T2V-A14B-Diffusers);
- ``tiny-wan22-ti2v``: ``WanPipeline`` with ``expand_timesteps`` and a 48-channel residual VAE
  (16x spatial, so sizes are multiples of 32), as Wan-AI/Wan2.2-TI2V-5B-Diffusers;
- ``tiny-wan22-i2v``: ``WanImageToVideoPipeline`` with two 36-channel experts (noise + mask +
  image latents) switched at 0.9 and no CLIP image encoder, as Wan-AI/Wan2.2-I2V-A14B-Diffusers;
- ``tiny-wan21-i2v``: ``WanImageToVideoPipeline`` with one 36-channel transformer that also attends
  to a CLIP image encoder's penultimate hidden states (``image_encoder`` + ``image_processor``), as
  Wan-AI/Wan2.1-I2V-14B-480P-Diffusers (and 720P: the same layout, flow_shift 5.0).

Built on first call (a few seconds each) and cached under :func:`zoo.paths.zoo_root`.
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from diffusers import AutoencoderKLWan, WanImageToVideoPipeline, WanPipeline
from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModelWithProjection

from zoo.cache import ensure_built
from zoo.paths import zoo_root
from zoo.tiny import (
    WanSizes,
    _seeded,
    _spec,
    wan_scheduler,
    wan_text_encoder,
    wan_transformer,
    wan_vae,
)
from zoo.vocab import t5_tokenizer

# The published boundaries: timesteps >= ratio x 1000 run the high-noise expert.
A14B_BOUNDARY = 0.875
I2V_BOUNDARY = 0.9
# The diffusers conversion writes flow_shift 3.0 for T2V-A14B (Wan2.2 itself samples with 12.0),
# 5.0 for TI2V-5B (the published folders' scheduler configs).
A14B_SHIFT, TI2V_SHIFT = 3.0, 5.0
# The low-noise expert's seed offset: its weights differ from the high-noise one's, so a step run
# on the wrong expert changes the output.
SECOND_EXPERT_SEED = 4
TINY = WanSizes()


def build_wan22_a14b(folder: Path, sizes: WanSizes = TINY) -> None:
    pipe = WanPipeline(
        tokenizer=t5_tokenizer(model_max_length=512), text_encoder=wan_text_encoder(sizes), vae=wan_vae(sizes),
        scheduler=wan_scheduler(A14B_SHIFT), transformer=wan_transformer(sizes),
        transformer_2=wan_transformer(sizes, SECOND_EXPERT_SEED), boundary_ratio=A14B_BOUNDARY,
    )
    pipe.save_pretrained(folder, safe_serialization=True)


def ti2v_vae(sizes: WanSizes) -> AutoencoderKLWan:
    """The Wan2.2 VAE's shape at toy width: residual, 2x2 patchified input (12 channels), 48 latents,
    16x spatial and 4x temporal compression."""
    _seeded(5)
    return AutoencoderKLWan(
        base_dim=sizes.vae_base_dim, decoder_base_dim=sizes.vae_base_dim, z_dim=48, dim_mult=[1, 1, 1, 1],
        num_res_blocks=1, attn_scales=[], temperal_downsample=[False, True, True], dropout=0.0,
        is_residual=True, in_channels=12, out_channels=12, patch_size=2, scale_factor_spatial=16,
        scale_factor_temporal=4, latents_mean=[0.0] * 48, latents_std=[1.0] * 48,
    ).eval()


def build_wan22_ti2v(folder: Path, sizes: WanSizes = TINY) -> None:
    pipe = WanPipeline(
        tokenizer=t5_tokenizer(model_max_length=512), text_encoder=wan_text_encoder(sizes), vae=ti2v_vae(sizes),
        scheduler=wan_scheduler(TI2V_SHIFT), transformer=wan_transformer(sizes, channels=(48, 48)),
        expand_timesteps=True,
    )
    pipe.save_pretrained(folder, safe_serialization=True)


def build_wan22_i2v(folder: Path, sizes: WanSizes = TINY) -> None:
    # 36 = 16 noise channels + 4 mask channels (one per frame of a temporal group) + 16 image latents.
    pipe = WanImageToVideoPipeline(
        tokenizer=t5_tokenizer(model_max_length=512), text_encoder=wan_text_encoder(sizes), vae=wan_vae(sizes),
        scheduler=wan_scheduler(A14B_SHIFT), transformer=wan_transformer(sizes, channels=(36, 16)),
        transformer_2=wan_transformer(sizes, SECOND_EXPERT_SEED, channels=(36, 16)), boundary_ratio=I2V_BOUNDARY,
    )
    pipe.save_pretrained(folder, safe_serialization=True)


# The tiny CLIP ViT: 32x32 images in 8x8 patches, 16 patch tokens + the class token = 17 image tokens
# (Wan2.1 I2V's ViT-H/14 at 224: 257 tokens of width 1280).
CLIP_IMAGE_SIDE, CLIP_PATCH, CLIP_WIDTH = 32, 8, 32
# OpenAI CLIP's normalisation, as the published image_processor/preprocessor_config.json.
CLIP_MEAN, CLIP_STD = [0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711]


def clip_image_encoder() -> CLIPVisionModelWithProjection:
    """The tiny CLIP vision tower (seed offset 6), the class Wan2.1 I2V's folders name (the pipeline reads
    its penultimate hidden states; the projection is never run)."""
    _seeded(6)
    return CLIPVisionModelWithProjection(CLIPVisionConfig(
        hidden_size=CLIP_WIDTH, intermediate_size=2 * CLIP_WIDTH, num_hidden_layers=3, num_attention_heads=4,
        image_size=CLIP_IMAGE_SIDE, patch_size=CLIP_PATCH, projection_dim=CLIP_WIDTH, hidden_act="gelu",
    )).eval()


def clip_image_processor() -> CLIPImageProcessor:
    return CLIPImageProcessor(size={"shortest_edge": CLIP_IMAGE_SIDE},
                              crop_size={"height": CLIP_IMAGE_SIDE, "width": CLIP_IMAGE_SIDE},
                              image_mean=CLIP_MEAN, image_std=CLIP_STD)


def build_wan21_i2v(folder: Path, sizes: WanSizes = TINY) -> None:
    pipe = WanImageToVideoPipeline(
        tokenizer=t5_tokenizer(model_max_length=512), text_encoder=wan_text_encoder(sizes), vae=wan_vae(sizes),
        scheduler=wan_scheduler(), transformer=wan_transformer(sizes, channels=(36, 16), image_dim=CLIP_WIDTH),
        image_encoder=clip_image_encoder(), image_processor=clip_image_processor(),
    )
    pipe.save_pretrained(folder, safe_serialization=True)


def _ensure(name: str, build, **recipe) -> Path:
    """``recipe``: what else the build depends on, stamped with the sizes (a change rebuilds the folder)."""
    sizes = replace(TINY)
    return ensure_built(zoo_root(), name, {**_spec(name, sizes), **recipe}, lambda d: build(d, sizes))


def ensure_tiny_wan22_a14b() -> Path:
    """A two-expert WanPipeline folder (boundary 0.875)."""
    return _ensure("tiny-wan22-a14b", build_wan22_a14b)


def ensure_tiny_wan22_ti2v() -> Path:
    """A WanPipeline folder with expanded timesteps and the 48-channel, 16x VAE."""
    return _ensure("tiny-wan22-ti2v", build_wan22_ti2v)


def ensure_tiny_wan22_i2v() -> Path:
    """A two-expert WanImageToVideoPipeline folder (boundary 0.9)."""
    return _ensure("tiny-wan22-i2v", build_wan22_i2v)


def ensure_tiny_wan21_i2v() -> Path:
    """A WanImageToVideoPipeline folder with a CLIP image encoder (the Wan2.1 I2V layout)."""
    return _ensure("tiny-wan21-i2v", build_wan21_i2v, image_encoder="CLIPVisionModelWithProjection",
                   clip=[CLIP_IMAGE_SIDE, CLIP_PATCH, CLIP_WIDTH])
