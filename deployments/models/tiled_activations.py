"""A tiling decoder's activation models: the two phases of a tiled decode, calibrated on the replica's VAE.

A tiled decode (deployments/models/vae_tiling.py) first decodes the tiles one after another, keeping each
decoded tile, then blends them into the output and post-processes it. Its peak is the larger of the two
phases (:data:`deployments.models.activation_features.TILED_PHASES`), not their sum: the tile's working set is
freed before the output is assembled. Measured (tiny Wan, 64 px tiles, float32, CPU meter): 1.51 MB from 96
to 128 px, then 56-58 B per output pixel from 192 px on; at real size on meta (Wan2.1's VAE, bfloat16):
1.19-1.30 GiB for the tiles phase at 256 px tiles, and 56-57 B per output pixel and frame assembling.
One straight line over both phases under-predicted a 320 px image by 40 % (0.60 of the peak), so:

- **the tiles phase** is fitted at the served tile, on outputs just beyond it and at twice its side
  (image: ``n``, ``n x pixels``; video: ``n``, ``n x frames``, ``n x pixels x frames``, from 9 and 17 frames),
  and a video's is at least what the fewest frames just beyond the tile hold (a floor per output);
- **the output phase** is one coefficient per output pixel (and frame), measured with the VAE's tile set to
  :data:`OUTPUT_TILE` px: the bytes per output pixel the assembly holds do not depend on the tile (Wan2.1's
  VAE on meta: 57 B at 64 px tiles, 56 at 256), and with small tiles the assembly dominates at sizes that run
  at start-up. The output's side doubles from 128 px until the peak grows with the pixels (within 10 %,
  ``CONVERGED``), at most to ``MAX_OUTPUT_SIDE`` (1024 px); the coefficient is the last peak over its pixels,
  at least the true one (the tiles phase adds to it).

Run by the decoder replica's warm-up (deployments/replica/warmup.py) and the tests.
"""
from __future__ import annotations

import math
from typing import Callable

from deployments.models import vae_tiling
from deployments.models.activation_features import (
    DECODE_FEATURES,
    TILED_PHASES,
    Regime,
    calibration_spec,
    features,
)
from deployments.models.families import FamilyTraits
from deployments.wire.spec import GenerationSpec, PipelineStage
from offload_core.planner.activation_model import ActivationModel, ActivationSample, calibrate

DECODE = PipelineStage.DECODE
OUTPUT_TILE = vae_tiling.TILE_MULTIPLE  # the smallest tile every served VAE takes
FIRST_OUTPUT_SIDE = 2 * OUTPUT_TILE
# 1024 px: with 64 px tiles, Wan2.1's VAE holds 57 B per output pixel from 1024 px on (meta: 129 B at 512),
# FLUX.1's 45 B, HunyuanVideo 1.5's 22.5 B a pixel and frame (the same at 2048 px); beyond the cap, the last
# figure is the peak over its pixels, at least the true one. At 2048 px HunyuanVideo 1.5's count on meta took
# 213 s of op dispatch, 56 s at 1024.
MAX_OUTPUT_SIDE = 16 * OUTPUT_TILE
# Doubling the side quadruples the pixels: the assembly dominates once the peak grows at least 0.9 x as fast.
CONVERGED = 0.9


def tiles_phase_shapes(facts: FamilyTraits, tile: int, untiled: Regime) -> tuple[GenerationSpec, ...]:
    """Shapes that separate the tiles phase's features: just beyond the tile and at twice its side."""
    m = facts.size_multiple
    near, far = (tile // m + 1) * m, math.ceil(2 * tile / m) * m

    def spec(name, side, frames, n):
        return calibration_spec(facts, f"tiles-{name}", side, frames, n, DECODE)

    if untiled is Regime.IMAGE:
        return spec("image-a", near, 1, 1), spec("image-b", far, 1, 2)
    # From 9 frames on: Wan's first chunk makes 5 frames its own case (real size, meta: fitted from 5, 17 and 9
    # frames, 832x480x81 came out 1.60x its count; from 9, 17 and 9, 0.99-1.06x on every request tried).
    # The fewest frames are the floor's (:func:`floor_shape`).
    t = facts.temporal_factor
    return (spec("video-a", near, 1 + 2 * t, 1), spec("video-b", near, 1 + 4 * t, 2),
            spec("video-c", far, 1 + 2 * t, 1))


def floor_shape(facts: FamilyTraits, tile: int) -> GenerationSpec:
    """The fewest frames a video has, just beyond the tile: its peak is the tiles phase's least."""
    m = facts.size_multiple
    return calibration_spec(facts, "tiles-video-floor", (tile // m + 1) * m, 1 + facts.temporal_factor, 1, DECODE)


def output_phase_model(facts: FamilyTraits, untiled: Regime, measure: Callable[[GenerationSpec], int],
                       dtype_bytes: int) -> tuple[ActivationModel, tuple[int, ...]]:
    """The output phase's bytes per output pixel (and frame), with the VAE's tile at :data:`OUTPUT_TILE`; and
    the sides measured."""
    phase = TILED_PHASES[untiled][1]
    frames = 1 if untiled is Regime.IMAGE else 1 + facts.temporal_factor  # per frame: the fewest frames serve
    m, side, sides, last = facts.size_multiple, FIRST_OUTPUT_SIDE, [], None
    while True:
        spec = calibration_spec(facts, f"output-{side}", math.ceil(side / m) * m, frames, 1, DECODE)
        peak, (size,) = measure(spec), features(facts, DECODE, spec, phase)
        sides.append(spec.width)
        if last is not None and peak / last[0] >= CONVERGED * size / last[1] or 2 * side > MAX_OUTPUT_SIDE:
            break
        last, side = (peak, size), 2 * side
    return ActivationModel(DECODE_FEATURES[phase], (peak / size,), dtype_bytes), tuple(sides)


def calibrate_tiled(facts: FamilyTraits, vae, regimes: set[Regime], measure: Callable[[GenerationSpec], int],
                    dtype_bytes: int) -> dict[Regime, ActivationModel]:
    """Both phases of each untiled regime in ``regimes`` on ``vae`` (tiling on; its tile restored after), each
    shape's peak by ``measure(spec)``."""
    tile = vae_tiling.tile_side(vae)
    if tile is None:
        raise vae_tiling.VaeTilingError("calibrate_tiled needs a VAE with its tiling on")
    models: dict[Regime, ActivationModel] = {}
    for untiled in sorted(regimes, key=lambda r: r.value):
        phase = TILED_PHASES[untiled][0]
        samples = [ActivationSample(features(facts, DECODE, s, phase), measure(s))
                   for s in tiles_phase_shapes(facts, tile, untiled)]
        models[phase] = calibrate(DECODE_FEATURES[phase], samples, dtype_bytes)
        if untiled is Regime.VIDEO:  # a floor per output: tiny Wan's 5 frames beyond the tile were 0.83-0.88 without
            models[Regime.TILED_VIDEO_FLOOR] = ActivationModel(
                DECODE_FEATURES[Regime.TILED_VIDEO_FLOOR], (float(measure(floor_shape(facts, tile))),), dtype_bytes)
    vae_tiling.set_tile(vae, OUTPUT_TILE)
    try:
        for untiled in regimes:
            models[TILED_PHASES[untiled][1]], _ = output_phase_model(facts, untiled, measure, dtype_bytes)
    finally:
        vae_tiling.set_tile(vae, tile)
    return models
