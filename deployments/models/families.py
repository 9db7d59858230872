"""Model families: which components each stage loads, and each stage's share of the pipeline.

The split is exact: the encoder runs the pipeline's own ``encode_prompt``, the denoiser runs the
same pipeline with ``prompt_embeds=...`` and ``output_type="latent"`` (same seeded generator, so
the same noise), and the decoder decodes the latents the way the pipeline's tail does. So the
staged result is bitwise the in-process ``pipe(prompt, generator=seed)`` result
(tests/deployments/models/test_families.py pins it).
"""
from __future__ import annotations

import json
import logging
import math
import pathlib
from dataclasses import dataclass
from typing import Callable

import torch

from deployments.wire.spec import (
    DenoiseProgress,
    EncodedPrompt,
    Family,
    GenerationSpec,
    PipelineStage,
)

logger = logging.getLogger(__name__)

PIPELINE_CLASSES = {"WanPipeline": Family.WAN, "FluxPipeline": Family.FLUX}

# Module components (the ones offload_core manages) and helpers each stage needs, per family.
ENCODE, DENOISE, DECODE = PipelineStage.ENCODE, PipelineStage.DENOISE, PipelineStage.DECODE
STAGE_MODULES = {
    Family.WAN: {ENCODE: ("text_encoder",), DENOISE: ("transformer",), DECODE: ("vae",)},
    Family.FLUX: {ENCODE: ("text_encoder", "text_encoder_2"), DENOISE: ("transformer",), DECODE: ("vae",)},
}
STAGE_HELPERS = {
    Family.WAN: {ENCODE: ("tokenizer",), DENOISE: ("scheduler",), DECODE: ()},
    Family.FLUX: {ENCODE: ("tokenizer", "tokenizer_2"), DENOISE: ("scheduler",), DECODE: ()},
}
# The pipelines' own default guidance (WanPipeline.__call__: 5.0, FluxPipeline.__call__: 3.5).
DEFAULT_GUIDANCE = {Family.WAN: 5.0, Family.FLUX: 3.5}


class UnsupportedModelFolder(ValueError):
    """The configured folder is not a diffusers folder of a supported family."""


@dataclass(frozen=True)
class FamilyFacts:
    """What the ingress needs to validate requests, read from the folder's configs (no weights)."""

    family: Family
    folder: str
    # Height and width must be multiples of this: VAE spatial factor x transformer patch (and 16
    # for Wan, whose check_inputs demands it).
    size_multiple: int
    # Wan decodes 1 + k * temporal_factor frames; 1 for image-only families.
    temporal_factor: int
    supports_video: bool
    supports_negative_prompt: bool
    default_guidance: float


def _read_json(path: pathlib.Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise UnsupportedModelFolder(f"cannot read {path}: {exc}") from exc


def read_family_facts(folder: str | pathlib.Path) -> FamilyFacts:
    root = pathlib.Path(folder)
    class_name = _read_json(root / "model_index.json").get("_class_name")
    if class_name not in PIPELINE_CLASSES:
        raise UnsupportedModelFolder(f"{root}: pipeline {class_name!r} is not one of {sorted(PIPELINE_CLASSES)}")
    family = PIPELINE_CLASSES[class_name]
    vae = _read_json(root / "vae" / "config.json")
    transformer = _read_json(root / "transformer" / "config.json")
    if family is Family.WAN:
        patch = transformer.get("patch_size", [1, 2, 2])
        spatial = int(vae.get("scale_factor_spatial", 8))
        multiple = math.lcm(16, spatial * int(patch[1]), spatial * int(patch[2]))
        return FamilyFacts(family, str(root), multiple, int(vae.get("scale_factor_temporal", 4)),
                           True, True, DEFAULT_GUIDANCE[family])
    vae_scale = 2 ** (len(vae["block_out_channels"]) - 1)
    return FamilyFacts(family, str(root), vae_scale * 2, 1, False, False, DEFAULT_GUIDANCE[family])


def uses_per_request(facts: FamilyFacts, stage: PipelineStage, steps: int, guidance_scale: float,
                     batched: bool = False) -> dict[str, int]:
    """Forward passes per request of each of the stage's components (what the planner weighs bytes by).

    ``batched``: the Denoiser's step batching runs guidance's two branches in one forward.
    """
    # Wan runs classifier-free guidance when guidance > 1: two encoder and two transformer passes
    # in the pipeline's own loop.
    cfg = 2 if facts.family is Family.WAN and guidance_scale > 1.0 else 1
    per_stage = {ENCODE: cfg, DENOISE: steps * (1 if batched else cfg), DECODE: 1}
    return {name: per_stage[PipelineStage(stage)] for name in STAGE_MODULES[facts.family][stage]}


def _pipeline_class(family: Family):
    import diffusers

    return diffusers.WanPipeline if family is Family.WAN else diffusers.FluxPipeline


def load_stage_pipeline(facts: FamilyFacts, stage: PipelineStage, dtype: torch.dtype):
    """The family's pipeline with only ``stage``'s components loaded (the rest None), safetensors only."""
    cls = _pipeline_class(facts.family)
    keep = set(STAGE_MODULES[facts.family][stage]) | set(STAGE_HELPERS[facts.family][stage])
    index = _read_json(pathlib.Path(facts.folder) / "model_index.json")
    skipped = {name: None for name, spec in index.items()
               if isinstance(spec, list) and spec[0] is not None and name not in keep}
    pipe = cls.from_pretrained(facts.folder, use_safetensors=True, dtype=dtype, **skipped)
    pipe.set_progress_bar_config(disable=True)
    _restore_scale_factors(pipe, facts)
    logger.info("stage %s loaded %s from %s: components %s, skipped %s", PipelineStage(stage).value, cls.__name__, facts.folder,
                sorted(keep), sorted(skipped))
    return pipe


def _restore_scale_factors(pipe, facts: FamilyFacts) -> None:
    """Without a VAE the pipelines fall back to a scale factor of 8; use the folder's real one."""
    vae = _read_json(pathlib.Path(facts.folder) / "vae" / "config.json")
    if facts.family is Family.WAN:
        pipe.vae_scale_factor_spatial = int(vae.get("scale_factor_spatial", 8))
        pipe.vae_scale_factor_temporal = int(vae.get("scale_factor_temporal", 4))
    else:
        pipe.vae_scale_factor = 2 ** (len(vae["block_out_channels"]) - 1)


def stage_modules(pipe, facts: FamilyFacts, stage: PipelineStage) -> dict[str, torch.nn.Module]:
    return {name: getattr(pipe, name) for name in STAGE_MODULES[facts.family][stage]}


def generator_for(spec: GenerationSpec) -> torch.Generator:
    # A CPU generator on every device: the noise, and so the output, does not depend on the GPU.
    return torch.Generator(device="cpu").manual_seed(spec.seed)


# Stage outputs cross Ray on the CPU: a CUDA tensor would be rebuilt on the receiver's GPU (the
# ingress has none). The copy back to the device is exact, so results stay bitwise.
CPU = torch.device("cpu")


@torch.no_grad()
def encode(pipe, facts: FamilyFacts, spec: GenerationSpec, device: torch.device) -> EncodedPrompt:
    if facts.family is Family.WAN:
        positive, negative = pipe.encode_prompt(
            prompt=spec.prompt, negative_prompt=spec.negative_prompt,
            do_classifier_free_guidance=spec.guidance_scale > 1.0, num_videos_per_prompt=spec.n,
            max_sequence_length=512, device=device)
        return EncodedPrompt(positive, negative_prompt_embeds=negative).to(CPU)
    positive, pooled, _text_ids = pipe.encode_prompt(
        prompt=spec.prompt, prompt_2=None, device=device, num_images_per_prompt=spec.n, max_sequence_length=512)
    return EncodedPrompt(positive, pooled_prompt_embeds=pooled).to(CPU)


def denoise(pipe, facts: FamilyFacts, encoded: EncodedPrompt, spec: GenerationSpec, device: torch.device,
            on_step: Callable[[DenoiseProgress], None] | None = None) -> torch.Tensor:
    """Latents exactly as ``pipe(..., output_type="latent")`` returns them, on the CPU."""
    encoded = encoded.to(device)  # the pipelines cast embeddings' dtype, never their device

    def step_end(_pipe, i, _t, _tensors):
        if on_step is not None:
            on_step(DenoiseProgress(spec.request_id, i + 1, spec.steps))
        return {}

    common = dict(height=spec.height, width=spec.width, num_inference_steps=spec.steps,
                  guidance_scale=spec.guidance_scale, generator=generator_for(spec), output_type="latent",
                  callback_on_step_end=step_end, callback_on_step_end_tensor_inputs=[])
    if facts.family is Family.WAN:
        # The embeddings already hold n rows, so one video per embedding row.
        out = pipe(prompt_embeds=encoded.prompt_embeds, negative_prompt_embeds=encoded.negative_prompt_embeds,
                   num_frames=spec.num_frames, num_videos_per_prompt=1, **common)
        return out.frames.to(CPU)
    out = pipe(prompt_embeds=encoded.prompt_embeds, pooled_prompt_embeds=encoded.pooled_prompt_embeds,
               num_images_per_prompt=1, **common)
    return out.images.to(CPU)


@torch.no_grad()
def decode(pipe, facts: FamilyFacts, latents: torch.Tensor, spec: GenerationSpec,
           device: torch.device | None = None) -> torch.Tensor:
    """Frames (n, frames, H, W, 3) float32 in [0, 1]: the pipeline's ``output_type="np"`` result.

    ``device``: where the VAE runs; None asks the pipeline, which walks every module's hooks and
    parameters (30 % of the tiny Wan's decode in a replica, py-spy): stage replicas pass theirs."""
    vae = pipe.vae
    device = pipe._execution_device if device is None else device
    if facts.family is Family.WAN:  # the tail of WanPipeline.__call__
        latents = latents.to(device, dtype=vae.dtype)
        mean = torch.tensor(vae.config.latents_mean).view(1, vae.config.z_dim, 1, 1, 1).to(latents.device, latents.dtype)
        inv_std = 1.0 / torch.tensor(vae.config.latents_std).view(1, vae.config.z_dim, 1, 1, 1).to(
            latents.device, latents.dtype)
        video = vae.decode(latents / inv_std + mean, return_dict=False)[0]
        return torch.from_numpy(pipe.video_processor.postprocess_video(video, output_type="np"))
    # the tail of FluxPipeline.__call__
    latents = pipe._unpack_latents(latents, spec.height, spec.width, pipe.vae_scale_factor)
    latents = (latents / vae.config.scaling_factor) + vae.config.shift_factor
    image = vae.decode(latents.to(device), return_dict=False)[0]
    return torch.from_numpy(pipe.image_processor.postprocess(image, output_type="np")).unsqueeze(1)


def load_full_pipeline(facts: FamilyFacts, dtype: torch.dtype):
    pipe = _pipeline_class(facts.family).from_pretrained(facts.folder, use_safetensors=True, dtype=dtype)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def reference_frames(pipe, facts: FamilyFacts, spec: GenerationSpec) -> torch.Tensor:
    """The in-process pipeline's result for ``spec``, in the decoder's layout (the bitwise reference)."""
    common = dict(prompt=spec.prompt, negative_prompt=spec.negative_prompt, height=spec.height, width=spec.width,
                  num_inference_steps=spec.steps, guidance_scale=spec.guidance_scale,
                  generator=generator_for(spec), output_type="np")
    if facts.family is Family.WAN:
        return torch.from_numpy(pipe(num_frames=spec.num_frames, num_videos_per_prompt=spec.n, **common).frames)
    return torch.from_numpy(pipe(num_images_per_prompt=spec.n, **common).images).unsqueeze(1)
