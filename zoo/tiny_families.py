"""The tiny zoo's newer families: SD3.5, Z-Image, Qwen-Image and HunyuanVideo 1.5 (text- and image-to-video),
at toy widths.

Real diffusers/transformers classes with tiny configs, seeded per component, written with
``save_pretrained`` and cached under :func:`zoo.paths.zoo_root` like :mod:`zoo.tiny`. Each keeps
what the engine and the adapters care about real: the component layout of the real folder
(``model_index.json``), the real schedulers' settings (``configs/models/real_model_configs.json``),
the text encoders' kinds (three for SD3.5, one of them a T5 with T5-XXL's 32128-row table; Qwen2.5-VL
with its vision tower for Qwen-Image; Qwen3 for Z-Image; Qwen2.5-VL text + ByT5 for HunyuanVideo 1.5, and
SigLIP for its image-to-video),
and the VAEs' real compression (8x; 16x and 4x in time for HunyuanVideo 1.5). A conformance run of
each takes a few seconds on one core.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from diffusers import (
    AutoencoderKL,
    AutoencoderKLHunyuanVideo15,
    AutoencoderKLQwenImage,
    ClassifierFreeGuidance,
    FlowMatchEulerDiscreteScheduler,
    HunyuanVideo15ImageToVideoPipeline,
    HunyuanVideo15Pipeline,
    HunyuanVideo15Transformer3DModel,
    QwenImageEditPipeline,
    QwenImageEditPlusPipeline,
    QwenImagePipeline,
    QwenImageTransformer2DModel,
    SD3Transformer2DModel,
    StableDiffusion3Pipeline,
    ZImagePipeline,
    ZImageTransformer2DModel,
)
from transformers import (
    CLIPTextConfig,
    CLIPTextModelWithProjection,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2_5_VLTextConfig,
    Qwen2_5_VLTextModel,
    Qwen2VLImageProcessorPil,
    Qwen3Config,
    Qwen3Model,
    SiglipImageProcessor,
    SiglipVisionConfig,
    SiglipVisionModel,
    T5Config,
    T5EncoderModel,
)

from zoo.cache import ensure_built
from zoo.paths import zoo_root
from zoo.tiny import _seeded, _spec
from zoo.vocab import clip_tokenizer, t5_tokenizer
from zoo.vocab_qwen import byt5_tokenizer, qwen_tokenizer, qwen_vl_tokenizer

# T5-XXL's (google/t5-v1_1-xxl) token table rows: SD3.5's third text encoder, its largest tensor.
T5_XXL_VOCAB_ROWS = 32128


@dataclass(frozen=True)
class ImageSizes:
    """The knobs of the image recipes (SD3.5, Z-Image, Qwen-Image); all go into the cache stamp."""

    width: int = 32  # text width = joint attention width = transformer inner width
    heads: int = 2
    head_dim: int = 16  # = sum of the rope axes (4, 6, 6)
    blocks: int = 2
    text_layers: int = 2
    # SD3.5's latent channels, as the real VAE has them: StableDiffusion3InpaintPipeline runs 16-channel
    # (or 33-channel inpainting) transformers only, so fewer would leave SD3.5's masks without a reference.
    sd3_latent_channels: int = 16


def _t5(vocab: int, width: int, layers: int, tie: bool = True) -> T5EncoderModel:
    return T5EncoderModel(T5Config(
        vocab_size=vocab, d_model=width, d_kv=width // 4, d_ff=2 * width, num_layers=layers, num_heads=4,
        feed_forward_proj="gated-gelu", relative_attention_num_buckets=32, relative_attention_max_distance=128,
        layer_norm_epsilon=1e-6, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0, tie_word_embeddings=tie,
    )).eval()


def _flux_style_vae(latent_channels: int, scaling: float, shift: float) -> AutoencoderKL:
    # Two levels -> vae_scale_factor 2 (the real ones have four: 8x); the transformers patch 2x2 on top.
    return AutoencoderKL(
        in_channels=3, out_channels=3, latent_channels=latent_channels, block_out_channels=(8, 16),
        layers_per_block=1, down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
        norm_num_groups=4, sample_size=32, scaling_factor=scaling, shift_factor=shift,
        use_quant_conv=False, use_post_quant_conv=False,
    ).eval()


def build_sd3(folder: Path, sizes: ImageSizes = ImageSizes()) -> None:
    """StableDiffusion3Pipeline: CLIP-L and CLIP-G (with projection), T5 with 32128 rows, SD3 MMDiT."""
    tokenizer = clip_tokenizer(model_max_length=77)
    clip_width = sizes.width // 2  # the two CLIP outputs are concatenated, then padded to T5's width

    def clip(offset: int, act: str) -> CLIPTextModelWithProjection:
        _seeded(offset)
        return CLIPTextModelWithProjection(CLIPTextConfig(
            vocab_size=len(tokenizer), hidden_size=clip_width, intermediate_size=2 * clip_width,
            num_hidden_layers=sizes.text_layers, num_attention_heads=2, max_position_embeddings=77, hidden_act=act,
            projection_dim=clip_width, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )).eval()

    text_encoder, text_encoder_2 = clip(21, "quick_gelu"), clip(22, "gelu")  # CLIP-L, OpenCLIP bigG
    _seeded(23)
    text_encoder_3 = _t5(T5_XXL_VOCAB_ROWS, sizes.width, sizes.text_layers)
    _seeded(24)
    transformer = SD3Transformer2DModel(
        sample_size=32, patch_size=2, in_channels=sizes.sd3_latent_channels, num_layers=sizes.blocks,
        attention_head_dim=sizes.head_dim, num_attention_heads=sizes.heads, joint_attention_dim=sizes.width,
        caption_projection_dim=sizes.heads * sizes.head_dim, pooled_projection_dim=2 * clip_width,
        out_channels=sizes.sd3_latent_channels, pos_embed_max_size=32, qk_norm="rms_norm",
    ).eval()
    _seeded(25)
    vae = _flux_style_vae(sizes.sd3_latent_channels, scaling=1.5305, shift=0.0609)  # SD3.5's VAE scaling and shift
    pipe = StableDiffusion3Pipeline(
        transformer=transformer, scheduler=FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0),
        vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, text_encoder_2=text_encoder_2,
        tokenizer_2=clip_tokenizer(model_max_length=77), text_encoder_3=text_encoder_3,
        tokenizer_3=t5_tokenizer(model_max_length=256),
    )
    pipe.save_pretrained(folder, safe_serialization=True)


def _qwen_text_config(vocab: int, width: int, layers: int, pad: int) -> dict:
    # mrope_section halves of the rotary dims per axis (t, h, w): head_dim 8 -> 4 = 1 + 1 + 2.
    return dict(vocab_size=vocab, hidden_size=width, intermediate_size=2 * width, num_hidden_layers=layers,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048, rope_theta=1e6,
                rms_norm_eps=1e-6, rope_scaling={"type": "default", "rope_type": "default", "mrope_section": [1, 1, 2]},
                bos_token_id=pad, eos_token_id=pad, pad_token_id=pad)


def build_zimage(folder: Path, sizes: ImageSizes = ImageSizes()) -> None:
    """ZImagePipeline: Qwen3 text model (chat template), single-stream S3-DiT, FLUX-style VAE."""
    tokenizer = qwen_tokenizer()
    pad = tokenizer.pad_token_id
    _seeded(31)
    text_encoder = Qwen3Model(Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=sizes.width, intermediate_size=2 * sizes.width,
        num_hidden_layers=sizes.text_layers + 1, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        max_position_embeddings=1024, rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=True,
        bos_token_id=pad, eos_token_id=pad, pad_token_id=pad,
    )).eval()  # Z-Image reads hidden_states[-2]: one layer more than the others, so two layers count
    _seeded(32)
    transformer = ZImageTransformer2DModel(
        all_patch_size=(2,), all_f_patch_size=(1,), in_channels=4, dim=sizes.heads * sizes.head_dim,
        n_layers=sizes.blocks, n_refiner_layers=1, n_heads=sizes.heads, n_kv_heads=sizes.heads, norm_eps=1e-5,
        qk_norm=True, cap_feat_dim=sizes.width, rope_theta=256.0, t_scale=1000.0, axes_dims=[4, 6, 6],
        axes_lens=[1536, 64, 64],
    ).eval()
    _seeded(33)
    vae = _flux_style_vae(4, scaling=0.3611, shift=0.1159)  # Z-Image uses FLUX.1's VAE
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, use_dynamic_shifting=False, shift=3.0)
    ZImagePipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                   transformer=transformer).save_pretrained(folder, safe_serialization=True)


def _qwen_image_components(sizes: ImageSizes, tokenizer, seed: int, zero_cond_t: bool = False) -> dict:
    """QwenImagePipeline's components: Qwen2.5-VL (with a one-block vision tower), QwenImage MMDiT, Wan-style VAE.
    ``tokenizer``'s vision markers, where it has them, are the text encoder's image ids (the edit pipelines
    feed it images); else they point at the last id, never produced (text-to-image feeds none)."""
    pad, last = tokenizer.pad_token_id, len(tokenizer) - 1
    markers = [tokenizer.convert_tokens_to_ids(t) if t in tokenizer.get_vocab() else last
               for t in ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")]
    _seeded(seed)
    text_encoder = Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(
        text_config=_qwen_text_config(len(tokenizer), sizes.width, sizes.text_layers, pad),
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=sizes.width,
                           patch_size=14, spatial_merge_size=2, fullatt_block_indexes=[0]),
        vision_start_token_id=markers[0], vision_end_token_id=markers[1], image_token_id=markers[2],
        video_token_id=markers[3],
    )).eval()
    _seeded(seed + 1)
    transformer = QwenImageTransformer2DModel(
        patch_size=2, in_channels=16 * 4, out_channels=16, num_layers=sizes.blocks, attention_head_dim=sizes.head_dim,
        num_attention_heads=sizes.heads, joint_attention_dim=sizes.width, guidance_embeds=False, axes_dims_rope=(4, 6, 6),
        zero_cond_t=zero_cond_t,
    ).eval()
    _seeded(seed + 2)
    # Three time-downsampling levels as the real one, so the spatial factor is the real 8.
    vae = AutoencoderKLQwenImage(base_dim=8, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1, attn_scales=[],
                                 temperal_downsample=[False, True, True]).eval()
    scheduler = FlowMatchEulerDiscreteScheduler(  # Qwen/Qwen-Image's scheduler config
        base_image_seq_len=256, base_shift=0.5, max_image_seq_len=8192, max_shift=0.9, shift=1.0,
        shift_terminal=0.02, time_shift_type="exponential", use_dynamic_shifting=True)
    return dict(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, transformer=transformer)


def build_qwen_image(folder: Path, sizes: ImageSizes = ImageSizes()) -> None:
    """QwenImagePipeline: Qwen2.5-VL (with a one-block vision tower), QwenImage MMDiT, Wan-style VAE."""
    QwenImagePipeline(**_qwen_image_components(sizes, qwen_tokenizer(), 41)).save_pretrained(
        folder, safe_serialization=True)


def build_qwen_image_edit(folder: Path, sizes: ImageSizes = ImageSizes(), plus: bool = True,
                          zero_cond_t: bool = False) -> None:
    """QwenImageEditPlusPipeline (Qwen-Image-Edit-2509's layout; ``plus`` False: QwenImageEditPipeline's, the
    first Qwen-Image-Edit's; ``zero_cond_t``: 2511's transformer): Qwen-Image's components, the vision markers
    in the tokenizer, and a ``processor`` folder as the real one's (Qwen2VLProcessor's tokenizer and image
    processor files). transformers' Qwen2VLProcessor also needs a video processor, which needs torchvision;
    the service loads the folder's processor without it (deployments/models/qwen_image_edit.py), so the
    pipeline is saved without one and the folder written as the real one is."""
    tokenizer = qwen_vl_tokenizer()
    pipeline = QwenImageEditPlusPipeline if plus else QwenImageEditPipeline
    pipeline(processor=None, **_qwen_image_components(sizes, tokenizer, 61, zero_cond_t)).save_pretrained(
        folder, safe_serialization=True)
    tokenizer.save_pretrained(folder / "processor")
    Qwen2VLImageProcessorPil().save_pretrained(folder / "processor")  # Qwen2.5-VL's: 14 px patches, merge 2
    index = json.loads((folder / "model_index.json").read_text())
    (folder / "model_index.json").write_text(json.dumps({**index, "processor": ["transformers", "Qwen2VLProcessor"]},
                                                        indent=2))


def _hunyuan15_components(sizes: ImageSizes, task_type: str, target_size: int, meanflow: bool = False) -> dict:
    """HunyuanVideo15Pipeline's components (480p layout): Qwen2.5-VL text model + ByT5 glyph encoder, the DiT,
    a 16x spatial / 4x temporal VAE, the real scheduler shift (5.0) and guider (CFG 6.0)."""
    tokenizer, tokenizer_2 = qwen_tokenizer(), byt5_tokenizer()
    _seeded(51)
    text_encoder = Qwen2_5_VLTextModel(Qwen2_5_VLTextConfig(
        **_qwen_text_config(len(tokenizer), sizes.width, sizes.text_layers + 1, tokenizer.pad_token_id)))
    text_encoder.eval()  # HunyuanVideo 1.5 reads hidden_states[-3]: one layer more, so two count
    _seeded(52)
    text_encoder_2 = _t5(len(tokenizer_2), sizes.width // 2, sizes.text_layers, tie=False)
    latent = 4
    _seeded(53)
    transformer = HunyuanVideo15Transformer3DModel(
        in_channels=2 * latent + 1, out_channels=latent, num_attention_heads=sizes.heads,
        attention_head_dim=sizes.head_dim, num_layers=sizes.blocks, num_refiner_layers=1, mlp_ratio=2.0,
        patch_size=1, patch_size_t=1, qk_norm="rms_norm", text_embed_dim=sizes.width,
        text_embed_2_dim=sizes.width // 2, image_embed_dim=8, rope_theta=256.0, rope_axes_dim=(4, 6, 6),
        target_size=target_size, task_type=task_type, use_meanflow=meanflow,
    ).eval()
    _seeded(54)
    vae = AutoencoderKLHunyuanVideo15(
        in_channels=3, out_channels=3, latent_channels=latent, block_out_channels=(8, 8, 8, 8, 8),
        layers_per_block=1, spatial_compression_ratio=16, temporal_compression_ratio=4, scaling_factor=1.03682,
    ).eval()
    return dict(
        text_encoder=text_encoder, tokenizer=tokenizer, transformer=transformer, vae=vae,
        scheduler=FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=5.0, use_dynamic_shifting=False),
        text_encoder_2=text_encoder_2, tokenizer_2=tokenizer_2, guider=ClassifierFreeGuidance(guidance_scale=6.0))


def build_hunyuan15(folder: Path, sizes: ImageSizes = ImageSizes()) -> None:
    """HunyuanVideo15Pipeline (480p t2v layout)."""
    HunyuanVideo15Pipeline(**_hunyuan15_components(sizes, "t2v", 640)).save_pretrained(folder, safe_serialization=True)


def build_hunyuan15_i2v(folder: Path, sizes: ImageSizes = ImageSizes(), meanflow: bool = False) -> None:
    """HunyuanVideo15ImageToVideoPipeline (480p i2v layout): text-to-video's components, plus a SigLIP
    vision tower (28 px, 14 px patches: 4 tokens; the real one 729 at 384 px) and its processor. Its
    transformer's target_size is 32, so the pipeline's own size for a square image is 32x32. ``meanflow``:
    the step-distilled checkpoints' transformer (a second timestep embedding)."""
    _seeded(55)
    image_encoder = SiglipVisionModel(SiglipVisionConfig(
        hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2, image_size=28,
        patch_size=14)).eval()
    feature_extractor = SiglipImageProcessor(size={"height": 28, "width": 28})
    HunyuanVideo15ImageToVideoPipeline(image_encoder=image_encoder, feature_extractor=feature_extractor,
                                       **_hunyuan15_components(sizes, "i2v", 32, meanflow)).save_pretrained(
        folder, safe_serialization=True)


def _ensure(name: str, build) -> Path:
    sizes = ImageSizes()
    return ensure_built(zoo_root(), name, _spec(name, sizes), lambda d: build(d, sizes))


def ensure_tiny_sd3() -> Path:
    return _ensure("tiny-sd3", build_sd3)


def ensure_tiny_zimage() -> Path:
    return _ensure("tiny-zimage", build_zimage)


def ensure_tiny_qwen_image() -> Path:
    return _ensure("tiny-qwen-image", build_qwen_image)


def ensure_tiny_qwen_image_edit() -> Path:
    return _ensure("tiny-qwen-image-edit", build_qwen_image_edit)


def ensure_tiny_hunyuan15() -> Path:
    return _ensure("tiny-hunyuan15", build_hunyuan15)


def ensure_tiny_hunyuan15_i2v() -> Path:
    return _ensure("tiny-hunyuan15-i2v", build_hunyuan15_i2v)

