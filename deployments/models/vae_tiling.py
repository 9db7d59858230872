"""Tiled VAE decoding: whether the decoder stage tiles, the tile it uses, and how each VAE class is told.

diffusers' VAEs decode a large output tile by tile (overlapping tiles, blended) once tiling is enabled:
the decode's working set is then about one tile's, whatever the output's size. Counted on meta at real
size (bench/real_size_activations.py --vae-tiling, bench/results/real-size-tiled-decodes-2026-12-08.json):
HunyuanVideo 1.5's 848x480x121 decode holds 82.38 GiB untiled (only the H200 holds it) and 13.59 GiB
tiled; Wan2.2-A14B's 1280x720x81 17.55 GiB and 3.89 GiB. The pixels differ from an untiled decode (the
blend), so the bitwise reference of a tiling decoder is the diffusers pipeline with ``vae.enable_tiling()``
at the same tile (tests/deployments/models/test_vae_tiling.py).

The VAE tiles only an output wider or taller than its tile: a smaller request is decoded, bitwise, as
without tiling (:func:`tiles`). Run by the decoder stage's replica (and the test and bench processes).
"""
from __future__ import annotations

import enum

from deployments.models.families import FamilyTraits

# Overlap kept between tiles, as diffusers' defaults: Wan's and Qwen-Image's 256 px tiles step 192 px (0.75),
# AutoencoderKL's and HunyuanVideo 1.5's overlap factor is 0.25.
STRIDE_FRACTION = 0.75
# A tile side the four VAE classes can all take: a multiple of 64 keeps the 0.75 stride a multiple of 48,
# which every spatial compression served (8 or 16) divides.
TILE_MULTIPLE = 64


class VaeTiling(str, enum.Enum):
    """StageArgs.vae_tiling: whether the decoder stage's VAE decodes large outputs tile by tile."""

    OFF = "off"  # never: bitwise the plain pipeline at every size, at the untiled decode's memory
    ON = "on"  # outputs larger than the tile are tiled (and an image-to-video's reference encoded so)
    AUTO = "auto"  # as the family's published usage: HunyuanVideo 1.5 tiles (diffusers' examples do), others not


class VaeTilingError(ValueError):
    """A tiling setting the stage's VAE cannot take (a typed error: the app's build or the replica's start)."""


def check_tile_px(tile_px: int | None) -> None:
    if tile_px is not None and (tile_px < TILE_MULTIPLE or tile_px % TILE_MULTIPLE):
        raise VaeTilingError(f"vae_tile_px {tile_px}: a tile side is a multiple of {TILE_MULTIPLE} px, at least "
                             f"{TILE_MULTIPLE} (its 0.75 stride must be whole latent pixels)")


def resolve(tiling: VaeTiling, facts: FamilyTraits) -> bool:
    """Whether the decoder tiles: ``auto`` is the family's published usage (its adapter's ``tiles_vae``)."""
    if tiling is VaeTiling.AUTO:
        from deployments.models.registry import adapter_for

        return adapter_for(facts).tiles_vae
    return tiling is VaeTiling.ON


def published(pipeline_class: str) -> bool:
    """Whether the family serving diffusers' ``pipeline_class`` tiles by default (``auto``; the plan CLI asks)."""
    from deployments.models.registry import adapters

    return any(a.tiles_vae for a in adapters() if pipeline_class in a.pipeline_classes)


def enable(vae, tile_px: int | None = None) -> int:
    """Turn ``vae``'s tiling on with square tiles of ``tile_px`` output pixels (None: the VAE's own default,
    256 px for Wan, Qwen-Image and HunyuanVideo 1.5, the config's sample_size for AutoencoderKL); returns
    the tile side. The overlap is diffusers' default fraction whatever the side."""
    check_tile_px(tile_px)
    if not hasattr(vae, "enable_tiling"):
        raise VaeTilingError(f"{type(vae).__name__} has no tiled decode: serve with vae_tiling off")
    vae.enable_tiling()
    side = tile_px or _side(vae)
    set_tile(vae, side)
    return side


def set_tile(vae, side: int) -> None:
    """Square tiles of ``side`` output pixels on a VAE whose tiling is on (a calibration sets another side
    and this one back)."""
    name = type(vae).__name__
    if hasattr(vae, "tile_sample_stride_height"):  # AutoencoderKLWan, AutoencoderKLQwenImage
        stride = int(side * STRIDE_FRACTION)
        vae.enable_tiling(tile_sample_min_height=side, tile_sample_min_width=side,
                          tile_sample_stride_height=stride, tile_sample_stride_width=stride)
    elif hasattr(vae, "tile_latent_min_height"):  # AutoencoderKLHunyuanVideo15
        latent = side // vae.config.spatial_compression_ratio
        vae.enable_tiling(tile_sample_min_height=side, tile_sample_min_width=side,
                          tile_latent_min_height=latent, tile_latent_min_width=latent)
    elif hasattr(vae, "tile_latent_min_size"):  # AutoencoderKL: no arguments; its tile is two attributes
        vae.tile_sample_min_size = side
        vae.tile_latent_min_size = side // 2 ** (len(vae.config.block_out_channels) - 1)
    else:
        raise VaeTilingError(f"{name} has no tiled decode this service knows (Wan, Qwen-Image, HunyuanVideo 1.5, "
                             "AutoencoderKL): serve with vae_tiling off")


def _side(vae) -> int:
    """The VAE's tile side now (its own default until set)."""
    if hasattr(vae, "tile_sample_min_height"):
        return min(vae.tile_sample_min_height, vae.tile_sample_min_width)
    return _square(vae.tile_sample_min_size, type(vae).__name__)


def tile_side(vae) -> int | None:
    """The output side beyond which ``vae`` decodes tile by tile; None while its tiling is off."""
    return _side(vae) if getattr(vae, "use_tiling", False) else None


def tiles(tile_px: int | None, height: int, width: int) -> bool:
    """Whether an output of ``height`` x ``width`` is decoded tile by tile by a VAE whose tile is ``tile_px``
    (None: not tiling). diffusers tiles a latent larger than the tile's latent on either side."""
    return tile_px is not None and (height > tile_px or width > tile_px)


def _square(size, name: str) -> int:
    if isinstance(size, (list, tuple)):
        if len(set(size)) != 1:
            raise VaeTilingError(f"{name}'s tile {tuple(size)} is not square: set vae_tile_px")
        size = size[0]
    return int(size)
