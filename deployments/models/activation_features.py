"""Activation memory per request shape, per model family: the features, the regimes, calibration.

Each stage's activation peak is modelled as a sum of coefficient x feature (offload_core.planner.
activations), with features chosen from what the family's stage computes over (measured on the
tiny zoo with offload_core.residency.activation_meter, every one within 1 % except where noted):

- encode: ``1`` (the text encoder's fixed-length pass: 512 tokens whatever the prompt) and ``n``;
- denoise: ``n`` and ``n x tokens`` (latent positions after patching: linear, 2304 B per token on
  tiny Wan, 2200 B on tiny Flux; a prompt padded to one length is in the first feature, an unpadded one's
  tokens are counted as latent positions: 1700-2050 B per text token beside 2200 per latent one on tiny
  Qwen-Image, :func:`text_tokens`), measured on the
  Denoiser's own path (:func:`denoise_as_served`: guidance's branches in one forward of twice the rows);
- decode: an image is ``n x pixels`` plus a constant; Wan's video VAE decodes frame by frame
  with caches, so videos are their own regime (``n x pixels`` and ``n x pixels x frames``: per
  pixel 1086 B at 5 frames, 1280 B at 9, 1330 B at 13: linear from 5 and 9 over-predicts 13
  frames by 11 %, the safe side).

A regime is calibrated on two shapes of its own (image: frames = 1; video: frames > 1). An in-context
edit (FLUX.1 Kontext) adds its image's packed tokens to the Denoiser's (the adapter's ``context_tokens``);
the decoder stage's encode of that image is leased at the image's fitted size (``families.condition_shape``;
the encode's peak is 0.71-0.83 of a decode's at one shape, bench/edit_memory.py).
"""
from __future__ import annotations

import enum
import math
from typing import Callable, Sequence

import torch

from deployments.models import vae_tiling
from deployments.models.families import FamilyTraits
from deployments.models.steppers import step_alone
from deployments.wire.spec import GenerationSpec, PipelineStage
from offload_core.planner.activation_model import ActivationModel, ActivationSample, calibrate


class Regime(str, enum.Enum):
    IMAGE = "image"  # one frame
    VIDEO = "video"  # several frames (Wan): the VAE decodes chunk by chunk with caches
    # A tiling decoder's output larger than its tile (deployments/models/tiled_activations.py): its peak is the
    # larger of two phases, each its own model: decoding the tiles (one tile's working set, the tiles kept) and
    # assembling the output (the tiles blended, the result, its post-processing: bytes per output pixel).
    TILED_IMAGE_TILES = "tiled image: tiles"
    TILED_IMAGE_OUTPUT = "tiled image: output"
    TILED_VIDEO_TILES = "tiled video: tiles"
    TILED_VIDEO_OUTPUT = "tiled video: output"
    TILED_VIDEO_FLOOR = "tiled video: fewest frames"  # the tiles phase's least: the fewest frames beyond the tile


FEATURES = {
    PipelineStage.ENCODE: ("1", "n"),
    PipelineStage.DENOISE: ("n", "n x tokens"),
}
DECODE_FEATURES = {
    Regime.IMAGE: ("n x pixels", "1"), Regime.VIDEO: ("n x pixels", "n x pixels x frames"),
    Regime.TILED_IMAGE_TILES: ("n", "n x pixels"), Regime.TILED_IMAGE_OUTPUT: ("n x pixels",),
    # A video's tiles phase grows with frames where the VAE decodes a tile's frames at once (HunyuanVideo 1.5:
    # 0.11 GiB a frame at real size) and hardly at all where it decodes them chunk by chunk (Wan: 1.19 GiB at 9
    # frames, 1.21 at 33; meta, 256 px tiles): its own feature, fitted from two frame counts.
    Regime.TILED_VIDEO_TILES: ("n", "n x frames", "n x pixels x frames"),
    Regime.TILED_VIDEO_OUTPUT: ("n x pixels x frames",),
    Regime.TILED_VIDEO_FLOOR: ("n",),
}
# The two phases of a tiled decode (the tiles', the output's), by the untiled regime of the same request, and
# a video's floor: the prediction is the largest of them.
TILED_PHASES = {Regime.IMAGE: (Regime.TILED_IMAGE_TILES, Regime.TILED_IMAGE_OUTPUT),
                Regime.VIDEO: (Regime.TILED_VIDEO_TILES, Regime.TILED_VIDEO_OUTPUT, Regime.TILED_VIDEO_FLOOR)}


def regime(spec: GenerationSpec) -> Regime:
    """The untiled regime of ``spec`` (a tiling decoder's phases: :data:`TILED_PHASES`)."""
    return Regime.VIDEO if spec.num_frames > 1 else Regime.IMAGE


def feature_names(stage: PipelineStage, spec: GenerationSpec, of: Regime | None = None) -> tuple[str, ...]:
    return DECODE_FEATURES[of or regime(spec)] if stage is PipelineStage.DECODE else FEATURES[stage]


def latent_tokens(facts: FamilyTraits, spec: GenerationSpec) -> int:
    """Latent positions the transformer attends over: latent frames x (H / multiple) x (W / multiple)."""
    latent_frames = 1 + (spec.num_frames - 1) // facts.temporal_factor
    return latent_frames * math.ceil(spec.height / facts.size_multiple) * math.ceil(spec.width / facts.size_multiple)


def context_tokens(facts: FamilyTraits, spec: GenerationSpec) -> int:
    """Tokens the request's image adds to every Denoiser forward (the family's adapter says: FLUX.1 Kontext's
    edits), counted as the latents' own."""
    from deployments.models.registry import adapter_for

    return adapter_for(facts).context_tokens(facts, spec)


def text_tokens(facts: FamilyTraits, spec: GenerationSpec) -> int:
    """Text tokens a Denoiser forward carries where prompts are not padded to one length (Qwen-Image's), counted
    as the latents' own: the encoder's count once the Denoiser has it, else the calibration stand-in's."""
    from deployments.models.registry import adapter_for

    return adapter_for(facts).text_tokens(facts, spec)


def features(facts: FamilyTraits, stage: PipelineStage, spec: GenerationSpec,
             of: Regime | None = None) -> tuple[float, ...]:
    """``spec``'s features for ``stage`` (the decoder's: for regime ``of``, else the request's untiled one)."""
    n, pixels = spec.n, spec.height * spec.width
    if stage is PipelineStage.ENCODE:
        return (1.0, float(n))
    if stage is PipelineStage.DENOISE:
        return (float(n), float(n * (latent_tokens(facts, spec) + context_tokens(facts, spec) + text_tokens(facts, spec))))
    values = {"1": 1, "n": n, "n x frames": n * spec.num_frames, "n x pixels": n * pixels,
              "n x pixels x frames": n * pixels * spec.num_frames}
    return tuple(float(values[name]) for name in DECODE_FEATURES[of or regime(spec)])


class StageActivations:
    """One stage's calibrated models, one per regime, and their predictions. ``tile``: the decoder's VAE
    decodes outputs larger than this side tile by tile (None: it does not tile)."""

    def __init__(self, facts: FamilyTraits, stage: PipelineStage, models: dict[Regime, ActivationModel],
                 tile: int | None = None):
        self.facts, self.stage, self.models, self.tile = facts, stage, models, tile

    def predict(self, spec: GenerationSpec, dtype_bytes: int | None = None) -> int:
        untiled = regime(spec)
        if self.stage is PipelineStage.DECODE and vae_tiling.tiles(self.tile, spec.height, spec.width):
            return max(self.models[phase].predict(features(self.facts, self.stage, spec, phase), dtype_bytes)
                       for phase in TILED_PHASES[untiled])
        model = self.models.get(untiled) or self.models[Regime.IMAGE]
        return model.predict(features(self.facts, self.stage, spec), dtype_bytes)

    def explain(self) -> str:
        tiled = f"tiles beyond {self.tile} px; " if self.tile is not None else ""
        return tiled + "; ".join(f"{r.value}: {m.explain()}" for r, m in self.models.items())


def calibrate_stage(facts: FamilyTraits, stage: PipelineStage, shapes: Sequence[GenerationSpec],
                    measure: Callable[[GenerationSpec], int], dtype_bytes: int) -> StageActivations:
    """Measure ``shapes`` (two per regime) with ``measure(spec) -> peak bytes`` and fit each regime.

    Each regime's first shape runs once unmeasured first. A device's first call of a kind allocates
    what it keeps for the process (on the H200 the first text-encoder call took cuBLAS's 32 MiB
    workspace: tiny Wan's encoder was predicted exactly 33,554,432 B over on a held-out shape).
    Counted in one sample, such a bump tilts the fit: in the smaller shape it lowers the per-token
    coefficient, so a larger request is under-predicted. On CPU the extra call changes no figure."""
    by_regime: dict[Regime, list[GenerationSpec]] = {}
    for spec in shapes:
        by_regime.setdefault(regime(spec), []).append(spec)
    models = {}
    for r, specs in by_regime.items():
        measure(specs[0])  # unmeasured: the process's one-time allocations for this kind of call
        samples = [ActivationSample(features(facts, stage, s), measure(s)) for s in specs]
        models[r] = calibrate(feature_names(stage, specs[0]), samples, dtype_bytes)
    return StageActivations(facts, stage, models)


def calibration_spec(facts: FamilyTraits, name: str, side: int, frames: int, n: int,
                     stage: PipelineStage | None = None, steps: int | None = None) -> GenerationSpec:
    """One calibration shape: a ``side`` x ``side`` request of ``frames`` and ``n`` outputs, guided as the family's
    default (with a negative prompt where the family takes one: its guided branch is the larger working set;
    a family that guides only with one, Qwen-Image, would otherwise be calibrated on half the rows), at
    ``steps`` (None: the fewest the model's schedule allows). A family that makes at most ``facts.max_n``
    outputs per request decodes no more (HunyuanVideo 1.5: one video at a time, so its decoder's peak is not
    linear in a larger n); its other stages still vary n, which their features need."""
    from deployments.models.registry import adapter_for

    if stage is PipelineStage.DECODE and facts.max_n is not None:
        n = min(n, facts.max_n)
    negative = "" if facts.supports_negative_prompt else None
    return GenerationSpec(f"calibrate-{name}", adapter_for(facts).warmup_prompt(facts), negative, side, side, frames,
                          facts.min_steps if steps is None else steps, facts.default_guidance, 0, n)


def calibration_shapes(facts: FamilyTraits, steps: int | None = None, stage: PipelineStage | None = None,
                       tile: int | None = None) -> tuple[GenerationSpec, ...]:
    """Two shapes per regime, small enough to run at start-up, that separate each stage's features
    (they differ in n and in size) (:func:`calibration_spec`). ``tile``: the decoder's VAE tiles beyond it, so
    its untiled shapes stay within it (its tiled phases: deployments/models/tiled_activations.py)."""
    m = facts.size_multiple
    # The larger image at least 16 tokens a side: 64 px is 16 x 16 at a multiple of 4 but 4 x 4 at FLUX.1's
    # (16), where the 512 text tokens swamp 4 and 16 image tokens, the per-token fit came out negative and
    # was dropped, and a 1024x1024 request was predicted at 0.11 of its peak (tiny FLUX.1 Kontext, CPU);
    # at 256 px: 0.91.
    small, large = math.ceil(32 / m) * m, max(math.ceil(64 / m) * m, 16 * m)
    if tile is not None:  # a decode carries no text tokens: any two sizes within the tile separate its features
        large = min(large, tile // m * m)
        small = max(m, min(small, large - m))  # AutoencoderKL's tile on the tiny zoo is 32 px at a multiple of 16

    def spec(name, side, frames, n):
        return calibration_spec(facts, name, side, frames, n, stage, steps)

    shapes = [spec("image-a", small, 1, 1), spec("image-b", large, 1, 2)]
    if facts.supports_video:
        t = facts.temporal_factor
        shapes += [spec("video-a", small, 1 + t, 1), spec("video-b", small, 1 + 2 * t, 2)]
    return tuple(shapes)


def stage_input(pipe, facts: FamilyTraits, stage: PipelineStage, spec: GenerationSpec):
    """A stand-in for the stage's input at ``spec``'s shape (zeros: activations depend on shapes, not
    values), so a replica calibrates without the other stages: the family adapter's."""
    from deployments.models.registry import adapter_for

    return adapter_for(facts).activation_input(pipe, facts, stage, spec)


def run_stage(pipe, facts: FamilyTraits, stage: PipelineStage, spec: GenerationSpec, device, value):
    """The stage's own call (as the deployments make it) on ``value`` from :func:`stage_input`."""
    from deployments.models import families

    if stage is PipelineStage.ENCODE:  # the request itself (an adapter may give it a stand-in reference image)
        return families.encode(pipe, facts, value if isinstance(value, GenerationSpec) else spec, device)
    if stage is PipelineStage.DENOISE:
        return denoise_as_served(pipe, facts, value, spec, device)
    return families.decode(pipe, facts, value, spec, device)


def denoise_as_served(pipe, facts: FamilyTraits, value, spec: GenerationSpec, device):
    """One request through the family's stepper, as the Denoiser runs every request (its step batch of one):
    guidance's two branches in one forward of twice the rows. Not the pipeline's loop, which runs them as two
    forwards on Wan, Qwen-Image and HunyuanVideo 1.5: calibrated on that, a guided request's peak in the
    service was 1.5-2.3x the prediction (tiny zoo, CPU: bench/denoise_peak_paths.py)."""
    from deployments.models.registry import adapter_for

    stepper = adapter_for(facts).stepper(pipe, facts, device)
    with torch.no_grad():
        return step_alone(stepper, stepper.start(value.to(device), spec))
