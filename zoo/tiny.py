"""The tiny zoo: real diffusers/transformers pipelines at toy widths, built locally and seeded.

Each ``ensure_*`` returns a diffusers folder that the real pipeline class loads with
``from_pretrained``; it is built on first call (a second or two; the medium one in a few seconds)
and cached under :func:`zoo.paths.zoo_root`. Nothing here downloads.

Widths are chosen so a 16x16 image (Wan: 1 latent token per frame after 8x VAE and 2x2 patches)
runs on one CPU core in about a second, while keeping what the engine cares about real:
several blocks per layer group, umT5's full 256384-row token table, and fp32 safetensors files.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import diffusers
import torch
import transformers
from diffusers import (
    AutoencoderKL,
    AutoencoderKLWan,
    FlowMatchEulerDiscreteScheduler,
    FluxKontextPipeline,
    FluxPipeline,
    FluxTransformer2DModel,
    UniPCMultistepScheduler,
    WanPipeline,
    WanTransformer3DModel,
)
from transformers import (
    CLIPTextConfig,
    CLIPTextModel,
    T5Config,
    T5EncoderModel,
    UMT5Config,
    UMT5EncoderModel,
)

from zoo.cache import ensure_built
from zoo.paths import zoo_root
from zoo.vocab import clip_tokenizer, t5_tokenizer

# Bump when a recipe changes in a way the sizes below do not capture (init, scheduler, tokenizer).
RECIPE_VERSION = 1
# umT5's real token-table row count (google/umt5-xxl): the table is the text encoder's largest tensor.
UMT5_VOCAB_ROWS = 256384
SEED = 0


@dataclass(frozen=True)
class WanSizes:
    """The knobs of a Wan-style recipe; all of them go into the cache stamp."""

    text_width: int = 32  # UMT5 d_model: 256384 x 32 fp32 = 32.8 MB token table
    text_layers: int = 2
    heads: int = 2
    head_dim: int = 16  # rope splits it into t/h/w axes: 8/4/4
    ffn_dim: int = 64
    blocks: int = 4
    vae_base_dim: int = 8


# ~300 MB fp32 denoiser: 8 blocks x (8 d^2 attention + 2 d ffn) = 8 x 9.4M params at d=768, ffn=3072.
MEDIUM_WAN = WanSizes(heads=12, head_dim=64, ffn_dim=3072, blocks=8)


@dataclass(frozen=True)
class FluxSizes:
    """The knobs of the Flux-style recipe; all of them go into the cache stamp."""

    width: int = 32  # joint attention dim = T5 d_model = CLIP hidden = pooled projection dim
    heads: int = 2
    head_dim: int = 16  # = sum(axes_dims_rope)
    double_blocks: int = 2  # transformer_blocks
    single_blocks: int = 2  # single_transformer_blocks
    text_layers: int = 2
    latent_channels: int = 4  # packed 2x2 into the transformer's 16 input channels


def _spec(name: str, sizes: object) -> dict[str, object]:
    return {
        "recipe": name,
        "version": RECIPE_VERSION,
        "seed": SEED,
        "sizes": asdict(sizes),
        "diffusers": diffusers.__version__,
        "transformers": transformers.__version__,
        "torch": torch.__version__.split("+")[0],
    }


def _seeded(offset: int) -> None:
    # One seed per component, so changing one component's size leaves the others' weights alone.
    torch.manual_seed(SEED + offset)


def wan_text_encoder(sizes: WanSizes) -> UMT5EncoderModel:
    """The tiny umT5 encoder (seed offset 1), with umT5's full 256384-row token table."""
    _seeded(1)
    return UMT5EncoderModel(
        UMT5Config(
            vocab_size=UMT5_VOCAB_ROWS, d_model=sizes.text_width, d_kv=sizes.text_width // 4,
            d_ff=2 * sizes.text_width, num_layers=sizes.text_layers, num_heads=4,
            feed_forward_proj="gated-gelu", relative_attention_num_buckets=32,
            relative_attention_max_distance=128, layer_norm_epsilon=1e-6,
            pad_token_id=0, eos_token_id=1, decoder_start_token_id=0,
        )
    ).eval()


def wan_transformer(sizes: WanSizes, seed_offset: int = 2, channels: tuple[int, int] = (16, 16),
                    image_dim: int | None = None) -> WanTransformer3DModel:
    """A tiny WanTransformer3DModel; ``channels`` = (in, out): 16/16 for Wan2.1 and the A14B experts,
    36/16 for image-to-video (noise + mask + image latents), 48/48 for TI2V-5B's 48-channel VAE.
    ``image_dim``: Wan2.1 image-to-video's CLIP width (its blocks get image key/value projections of
    the model width, as the published folders' ``added_kv_proj_dim``)."""
    _seeded(seed_offset)
    return WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=sizes.heads, attention_head_dim=sizes.head_dim,
        in_channels=channels[0], out_channels=channels[1], text_dim=sizes.text_width, freq_dim=32,
        ffn_dim=sizes.ffn_dim, num_layers=sizes.blocks, cross_attn_norm=True,
        qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=32, image_dim=image_dim,
        added_kv_proj_dim=None if image_dim is None else sizes.heads * sizes.head_dim,
    ).eval()


def wan_vae(sizes: WanSizes) -> AutoencoderKLWan:
    """The tiny Wan2.1 VAE (16 latent channels, 8x spatial, 4x temporal)."""
    _seeded(3)
    return AutoencoderKLWan(
        base_dim=sizes.vae_base_dim, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
        attn_scales=[], temperal_downsample=[False, True, True], dropout=0.0,
    ).eval()


def wan_scheduler(flow_shift: float = 3.0) -> UniPCMultistepScheduler:
    # The real Wan settings (configs/models/real_model_configs.json); the shift is the family's.
    return UniPCMultistepScheduler(
        prediction_type="flow_prediction", use_flow_sigmas=True, num_train_timesteps=1000, flow_shift=flow_shift
    )


def build_wan(folder: Path, sizes: WanSizes) -> None:
    """Write a WanPipeline folder with the given sizes into ``folder``."""
    tokenizer = t5_tokenizer(model_max_length=512)
    assert len(tokenizer) <= UMT5_VOCAB_ROWS, "tokenizer ids must index inside the token table"
    text_encoder = wan_text_encoder(sizes)
    transformer = wan_transformer(sizes)
    vae = wan_vae(sizes)
    scheduler = wan_scheduler()
    pipe = WanPipeline(tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, scheduler=scheduler, transformer=transformer)
    pipe.save_pretrained(folder, safe_serialization=True)


def flux_components(sizes: FluxSizes, vae_levels: int = 2) -> dict:
    """FluxPipeline's components: CLIP + T5 encoders, two transformer groups, an AutoencoderKL of
    ``vae_levels`` levels (2: vae_scale_factor 2; the real one's 4: 8)."""
    tokenizer = clip_tokenizer(model_max_length=77)
    tokenizer_2 = t5_tokenizer(model_max_length=512)
    _seeded(11)
    text_encoder = CLIPTextModel(
        CLIPTextConfig(
            vocab_size=len(tokenizer), hidden_size=sizes.width, intermediate_size=2 * sizes.width,
            num_hidden_layers=sizes.text_layers, num_attention_heads=4, max_position_embeddings=77,
            hidden_act="quick_gelu", layer_norm_eps=1e-5, projection_dim=sizes.width,
            bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
    ).eval()
    _seeded(12)
    text_encoder_2 = T5EncoderModel(
        T5Config(
            vocab_size=len(tokenizer_2), d_model=sizes.width, d_kv=sizes.width // 4, d_ff=2 * sizes.width,
            num_layers=sizes.text_layers, num_heads=4, feed_forward_proj="gated-gelu",
            relative_attention_num_buckets=32, relative_attention_max_distance=128,
            layer_norm_epsilon=1e-6, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0,
        )
    ).eval()
    _seeded(13)
    transformer = FluxTransformer2DModel(
        patch_size=1, in_channels=4 * sizes.latent_channels, num_layers=sizes.double_blocks,
        num_single_layers=sizes.single_blocks, attention_head_dim=sizes.head_dim,
        num_attention_heads=sizes.heads, joint_attention_dim=sizes.width,
        pooled_projection_dim=sizes.width, guidance_embeds=True, axes_dims_rope=(4, 6, 6),
    ).eval()
    _seeded(14)
    # Two levels -> vae_scale_factor 2, so a 32x32 image is a 16x16 latent, 8x8 = 64 packed tokens.
    vae = AutoencoderKL(
        in_channels=3, out_channels=3, latent_channels=sizes.latent_channels,
        block_out_channels=(8, 16) if vae_levels == 2 else (8,) * vae_levels, layers_per_block=1,
        down_block_types=("DownEncoderBlock2D",) * vae_levels, up_block_types=("UpDecoderBlock2D",) * vae_levels,
        norm_num_groups=4, sample_size=32, scaling_factor=0.3611, shift_factor=0.1159,
        use_quant_conv=False, use_post_quant_conv=False,
    ).eval()
    # FLUX.1-dev's scheduler settings, with sequence bounds scaled to the tiny latents.
    scheduler = FlowMatchEulerDiscreteScheduler(
        shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
        base_image_seq_len=16, max_image_seq_len=1024,
    )
    return dict(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                text_encoder_2=text_encoder_2, tokenizer_2=tokenizer_2, transformer=transformer)


def build_flux(folder: Path, sizes: FluxSizes = FluxSizes()) -> None:
    """Write a FluxPipeline folder (CLIP + T5 encoders, two transformer groups, AutoencoderKL)."""
    FluxPipeline(**flux_components(sizes)).save_pretrained(folder, safe_serialization=True)


def build_flux_kontext(folder: Path, sizes: FluxSizes = FluxSizes()) -> None:
    """Write a FluxKontextPipeline folder: FLUX.1's components with a four-level VAE (8x, as the real one), so
    the image the pipeline fits to about a megapixel is 4096 packed tokens here as on the real model (a
    two-level VAE would make it 65536)."""
    FluxKontextPipeline(**flux_components(sizes, vae_levels=4)).save_pretrained(folder, safe_serialization=True)


def ensure_tiny_wan() -> Path:
    """A WanPipeline folder: UMT5 with 256384 x 32 token table, 4-block transformer, tiny Wan VAE."""
    sizes = WanSizes()
    return ensure_built(zoo_root(), "tiny-wan", _spec("tiny-wan", sizes), lambda d: build_wan(d, sizes))


def ensure_medium_wan() -> Path:
    """A WanPipeline folder whose transformer is ~300 MB fp32 (8 blocks at width 768), for benches."""
    return ensure_built(zoo_root(), "medium-wan", _spec("medium-wan", MEDIUM_WAN), lambda d: build_wan(d, MEDIUM_WAN))


def ensure_tiny_flux() -> Path:
    """A FluxPipeline folder: 2 double + 2 single blocks, CLIP + T5 encoders, two-level AutoencoderKL."""
    sizes = FluxSizes()
    return ensure_built(zoo_root(), "tiny-flux", _spec("tiny-flux", sizes), lambda d: build_flux(d, sizes))


def ensure_tiny_flux_kontext() -> Path:
    """A FluxKontextPipeline folder: tiny FLUX.1's encoders and transformer, a four-level AutoencoderKL."""
    sizes = FluxSizes()
    return ensure_built(zoo_root(), "tiny-flux-kontext", _spec("tiny-flux-kontext", sizes),
                        lambda d: build_flux_kontext(d, sizes))
