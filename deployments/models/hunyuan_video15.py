"""HunyuanVideo 1.5 (diffusers ``HunyuanVideo15Pipeline``): Qwen2.5-VL text + ByT5 glyph encoders, the 8.3B DiT,
a 16x spatial / 4x temporal VAE.

Videos of ``1 + 4k`` frames (sides multiples of 16). Knobs as the pipeline means them: guidance is
the folder's ``ClassifierFreeGuidance`` guider, whose ``guidance_scale`` (6.0 in the 480p folder)
the API's ``guidance_scale`` replaces per request; at 1 there is one branch. The negative prompt
runs through both encoders ("" when none). The pipeline runs guidance's branches as two forwards;
step batching runs them in one. Two gaps of diffusers 0.42 the adapter works around, exactly:
the pipeline cannot be built without its VAE (its ``__init__`` reads ``vae.config``), so the
encoder and Denoiser stages get the VAE built on the meta device (no weights) and then dropped;
it fails for ``num_videos_per_prompt > 1`` (its image embeddings keep one row per prompt), so
``n`` videos would be asked for as ``n`` copies of the prompt; but its VAE cannot decode a batch of
two at any size (a causal-mask broadcast error), so the family declares ``max_n=1``: a request is
one video (requests still share the Denoiser's forwards). The decoder decodes its rows one at a
time, so the start-up activation calibration, which varies ``n``, still runs. It has no step
callback, so progress is reported from its scheduler's ``step``, called once per denoising step.
Run by the stage replicas; :meth:`HunyuanVideo15Adapter.facts` by the ingress (json only).
"""
from __future__ import annotations

import copy
import logging
import math
import pathlib
from dataclasses import dataclass

import torch

from deployments.models.adapter import (
    CPU,
    DECODE,
    DENOISE,
    ENCODE,
    FamilyAdapter,
    FamilyTraits,
    generator_for,
    read_json,
)
from deployments.models.step_cache import BlockForm, BlockOutput
from deployments.models.steppers import BatchKey, StepRequest, TransformerStepper, cached, guided_noise, split_noise
from deployments.wire.prompt_tensors import PromptTensors
from deployments.wire.spec import DenoiseProgress, Family, PipelineStage

logger = logging.getLogger(__name__)

TEXT_TOKENS, GLYPH_TOKENS = 1000, 256  # the pipeline's tokenizer_max_length and tokenizer_2_max_length
VISION_TOKENS = 729  # the pipeline's vision_num_semantic_tokens: zero image embeddings in text-to-video
# The guider settings this adapter's stepper reproduces (ClassifierFreeGuidance defaults, the 480p folder's).
GUIDER_DEFAULTS = {"guidance_rescale": 0.0, "use_original_formulation": False, "start": 0.0, "stop": 1.0}
INPUTS = ("encoder_hidden_states", "encoder_attention_mask", "encoder_hidden_states_2", "encoder_attention_mask_2")


@dataclass(frozen=True)
class HunyuanPrompt(PromptTensors):
    """``HunyuanVideo15Pipeline.encode_prompt``'s four tensors per branch: Qwen2.5-VL (n, 1000, 3584) + mask,
    ByT5 glyphs (n, 256, 1472) + mask (zeros when the prompt quotes no text)."""

    prompt_embeds: torch.Tensor
    prompt_embeds_mask: torch.Tensor
    prompt_embeds_2: torch.Tensor
    prompt_embeds_mask_2: torch.Tensor
    negative: "HunyuanPrompt | None" = None  # the same for the negative prompt, with guidance only
    # Image-to-video (deployments.models.hunyuan_video15_i2v): the image encoder's hidden states of the
    # reference image (n, 729, 1152 on the real SigLIP), from the encoder stage; and the VAE's latents of it
    # as the first frame with the mask of the given frame (n, 32 + 1, frames, h, w), from the decoder stage.
    image_embeds: torch.Tensor | None = None
    image_condition: torch.Tensor | None = None

    def to(self, device: torch.device) -> "HunyuanPrompt":
        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device)

        return HunyuanPrompt(*(t.to(device) for t in self.tensors()), move(self.negative),
                             move(self.image_embeds), move(self.image_condition))

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """In the transformer's order (``INPUTS``)."""
        return self.prompt_embeds, self.prompt_embeds_mask, self.prompt_embeds_2, self.prompt_embeds_mask_2


def _guided(scale: float) -> bool:
    return not math.isclose(scale, 1.0)  # ClassifierFreeGuidance._is_cfg_enabled (default formulation)


# HunyuanVideo15TransformerBlock returns (hidden, encoder) and takes the joint text mask per row.
HUNYUAN15_BLOCKS = BlockForm(BlockOutput.HIDDEN_ENCODER, ("hidden_states", "encoder_hidden_states", "temb",
                                                          "attention_mask"))


class HunyuanVideo15Stepper(TransformerStepper):
    """HunyuanVideo15Pipeline's loop (diffusers 0.42), one step for a batch; both guidance branches in one forward."""

    family = Family.HUNYUAN_VIDEO15.value

    def start(self, encoded: HunyuanPrompt, spec, on_step=None) -> StepRequest:
        import numpy as np
        from diffusers.pipelines.hunyuan_video1_5.pipeline_hunyuan_video1_5 import retrieve_timesteps

        pipe, device, dtype = self.pipe, self.device, self.dtype
        encoded = encoded.to(device)
        scheduler = copy.deepcopy(pipe.scheduler)
        timesteps, _ = retrieve_timesteps(scheduler, spec.steps, device,
                                          sigmas=np.linspace(1.0, 0.0, spec.steps + 1)[:-1])
        latents = pipe.prepare_latents(spec.n, pipe.num_channels_latents, spec.height, spec.width, spec.num_frames,
                                       dtype, device, generator_for(spec), None)
        cond = dict(zip(INPUTS, (t.to(dtype) for t in encoded.tensors())))
        uncond = dict(zip(INPUTS, (t.to(dtype) for t in encoded.negative.tensors()))) if _guided(spec.guidance_scale) else None
        key = BatchKey(tuple(latents.shape[1:]), dtype, TEXT_TOKENS, uncond is not None)
        return StepRequest(spec, key, scheduler, timesteps, latents, cond, uncond, on_step)

    def condition(self, batch: list[StepRequest], latents: torch.Tensor) -> torch.Tensor:
        """The condition latents and mask joined to the noise on the channel axis: text-to-video's are zeros
        (prepare_cond_latents_and_mask)."""
        return latents.new_zeros(latents.shape[0], latents.shape[1] + 1, *latents.shape[2:])

    def image_embeds(self, batch: list[StepRequest], rows: int) -> torch.Tensor:
        """One branch's image embeddings: text-to-video's are zeros."""
        return torch.zeros(rows, VISION_TOKENS, self.pipe.transformer.config.image_embed_dim, dtype=self.dtype,
                           device=self.device)

    def extra_inputs(self, batch: list[StepRequest], dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """One branch's further transformer inputs, by name: text-to-video's pipeline passes none."""
        return {}

    def forward(self, batch: list[StepRequest]) -> list[torch.Tensor]:
        latents = torch.cat([r.latents for r in batch])
        model_input = torch.cat([latents, self.condition(batch, latents)], dim=1)
        timestep = torch.cat([r.timesteps[r.step].expand(r.latents.shape[0]) for r in batch]).to(model_input.dtype)
        branches = [[r.cond for r in batch]]
        guided = batch[0].key.guided
        image_embeds = self.image_embeds(batch, latents.shape[0])
        extra = self.extra_inputs(batch, model_input.dtype)
        if guided:  # the weights stream once for both branches; both attend to the same image
            branches.append([r.uncond for r in batch])
            model_input, timestep = torch.cat([model_input, model_input]), torch.cat([timestep, timestep])
            image_embeds = torch.cat([image_embeds, image_embeds])
            extra = {name: torch.cat([value, value]) for name, value in extra.items()}
        inputs = {name: torch.cat([b[name] for rows in branches for b in rows]) for name in INPUTS} | extra
        with cached(self.pipe.transformer, batch, guided, HUNYUAN15_BLOCKS):
            noise = self.pipe.transformer(hidden_states=model_input, image_embeds=image_embeds, timestep=timestep,
                                          return_dict=False, **inputs)[0]
        if guided:
            cond, uncond = noise.chunk(2)
            return guided_noise(batch, cond, uncond)
        return split_noise(batch, noise)


class HunyuanVideo15Adapter(FamilyAdapter):
    family = Family.HUNYUAN_VIDEO15
    pipeline_classes = ("HunyuanVideo15Pipeline",)
    stage_modules = {ENCODE: ("text_encoder", "text_encoder_2"), DENOISE: ("transformer",), DECODE: ("vae",)}
    stage_helpers = {ENCODE: ("tokenizer", "tokenizer_2", "guider"), DENOISE: ("scheduler", "guider"), DECODE: ()}
    serves = ("video",)
    # Its untiled 848x480x121 decode holds 82.38 GiB at real size (only the H200 holds it); tiled, 13.59 GiB.
    # diffusers' examples for the pipeline call vae.enable_tiling().
    tiles_vae = True

    def warmup_prompt(self, facts) -> str:
        # The glyph encoder (text_encoder_2, ByT5) runs only for text in quotes (extract_glyph_texts):
        # a warm-up without any would leave it unmeasured until a request quotes some.
        return 'a sign that reads "OPEN"'

    def unsupported_variant(self, index, folder) -> str | None:
        guider = read_json(folder / "guider" / "guider_config.json")
        other = {k: guider[k] for k, v in GUIDER_DEFAULTS.items() if k in guider and guider[k] != v}
        if guider.get("_class_name") != "ClassifierFreeGuidance" or other:
            return (f"HunyuanVideo15Pipeline with guider {guider.get('_class_name')} {other} is not handled "
                    f"(the adapter reproduces ClassifierFreeGuidance with {GUIDER_DEFAULTS})")
        return None

    def facts(self, folder, index) -> FamilyTraits:
        vae = read_json(folder / "vae" / "config.json")
        patch = int(read_json(folder / "transformer" / "config.json").get("patch_size", 1))
        guidance = float(read_json(folder / "guider" / "guider_config.json").get("guidance_scale", 6.0))
        return FamilyTraits(self.family, str(folder), int(vae.get("spatial_compression_ratio", 16)) * patch,
                           int(vae.get("temporal_compression_ratio", 4)), True, True, guidance,
                           pipeline_class=index["_class_name"], modalities=self.modalities(index), max_n=1)

    def load_stage_pipeline(self, facts, stage, dtype, loaded=None):
        """The base loading, except that a stage without the VAE gets it on the meta device for the
        pipeline's ``__init__`` (which reads its config) and then none."""
        if "vae" in self.modules(facts, stage):
            return super().load_stage_pipeline(facts, stage, dtype, loaded)
        from diffusers import AutoencoderKLHunyuanVideo15

        with torch.device("meta"):
            stand_in = AutoencoderKLHunyuanVideo15.from_config(
                AutoencoderKLHunyuanVideo15.load_config(pathlib.Path(facts.folder) / "vae"))
        cls, keep = self.pipeline_type(facts), set(self.modules(facts, stage)) | set(self.helpers(facts, stage))
        index = read_json(pathlib.Path(facts.folder) / "model_index.json")
        skipped = {name: None for name, spec in index.items()
                   if isinstance(spec, list) and spec[0] is not None and name not in keep | {"vae"}}
        pipe = cls.from_pretrained(facts.folder, use_safetensors=True, dtype=dtype, vae=stand_in, **skipped,
                                   **(loaded or {}))
        pipe.register_modules(vae=None)
        pipe.set_progress_bar_config(disable=True)
        logger.info("stage %s loaded %s from %s: components %s, skipped %s (the VAE only as a meta-device "
                    "stand-in for the pipeline's __init__)", PipelineStage(stage).value, cls.__name__, facts.folder,
                    sorted(keep), sorted(skipped))
        return pipe

    @torch.no_grad()
    def encode(self, pipe, facts, spec, device) -> HunyuanPrompt:
        def run(prompt):  # n copies of the prompt: the pipeline's n videos (see the module docstring)
            prompts = None if prompt is None else [prompt] * spec.n
            return pipe.encode_prompt(prompt=prompts, device=device, dtype=pipe.text_encoder.dtype, batch_size=spec.n)

        negative = HunyuanPrompt(*run(spec.negative_prompt)) if _guided(spec.guidance_scale) else None
        return HunyuanPrompt(*run(spec.prompt), negative).to(CPU)

    def denoise(self, pipe, facts, encoded, spec, device, on_step=None) -> torch.Tensor:
        encoded, guider, step = encoded.to(device), pipe.guider, pipe.scheduler.step
        negative = encoded.negative or HunyuanPrompt(*(None,) * 4)
        done = []

        def counted_step(*args, **kwargs):  # once per denoising step: the pipeline has no step callback
            out = step(*args, **kwargs)
            done.append(1)
            if on_step is not None:
                on_step(DenoiseProgress(spec.request_id, len(done), spec.steps))
            return out

        pipe.guider, pipe.scheduler.step = guider.new(guidance_scale=spec.guidance_scale), counted_step
        try:
            out = pipe(prompt_embeds=encoded.prompt_embeds, prompt_embeds_mask=encoded.prompt_embeds_mask,
                       prompt_embeds_2=encoded.prompt_embeds_2, prompt_embeds_mask_2=encoded.prompt_embeds_mask_2,
                       negative_prompt_embeds=negative.prompt_embeds,
                       negative_prompt_embeds_mask=negative.prompt_embeds_mask,
                       negative_prompt_embeds_2=negative.prompt_embeds_2,
                       negative_prompt_embeds_mask_2=negative.prompt_embeds_mask_2,
                       height=spec.height, width=spec.width, num_frames=spec.num_frames,
                       num_inference_steps=spec.steps, generator=generator_for(spec), output_type="latent")
        finally:
            pipe.guider = guider
            del pipe.scheduler.step  # the class's method again
        return out.frames.to(CPU)

    @torch.no_grad()
    def decode(self, pipe, facts, latents, spec, device) -> torch.Tensor:
        vae = pipe.vae  # the tail of HunyuanVideo15Pipeline.__call__, one video at a time (max_n)
        videos = [vae.decode(row.to(device, vae.dtype) / vae.config.scaling_factor, return_dict=False)[0]
                  for row in latents.split(1)]
        return torch.from_numpy(pipe.video_processor.postprocess_video(torch.cat(videos), output_type="np"))

    def stepper(self, pipe, facts, device) -> HunyuanVideo15Stepper:
        return HunyuanVideo15Stepper(pipe, facts, device)

    def reference_frames(self, pipe, facts, spec) -> torch.Tensor:
        guider = pipe.guider
        pipe.guider = guider.new(guidance_scale=spec.guidance_scale)
        try:
            negative = None if spec.negative_prompt is None else [spec.negative_prompt] * spec.n
            frames = pipe(prompt=[spec.prompt] * spec.n, negative_prompt=negative, height=spec.height,
                          width=spec.width, num_frames=spec.num_frames, num_inference_steps=spec.steps,
                          generator=generator_for(spec), output_type="np").frames
        finally:
            pipe.guider = guider
        return torch.from_numpy(frames)

    def uses_per_request(self, facts, stage, steps, guidance_scale, batched=False) -> dict[str, int]:
        # Guided: both encoders run for the negative prompt too, and the pipeline's guider runs a
        # second transformer forward per step (step batching joins both branches in one).
        cfg = 2 if _guided(guidance_scale) else 1
        return self.uses_by_stage(facts, stage, encode=cfg, denoise=steps * (1 if batched else cfg))

    def activation_input(self, pipe, facts, stage, spec):
        stage = PipelineStage(stage)
        if stage is ENCODE:
            return None
        if stage is DENOISE:
            config, n = pipe.transformer.config, spec.n
            branch = HunyuanPrompt(torch.zeros(n, TEXT_TOKENS, config.text_embed_dim), torch.ones(n, TEXT_TOKENS),
                                   torch.zeros(n, GLYPH_TOKENS, config.text_embed_2_dim), torch.zeros(n, GLYPH_TOKENS))
            return HunyuanPrompt(*branch.tensors(), branch if _guided(spec.guidance_scale) else None)
        frames = 1 + (spec.num_frames - 1) // facts.temporal_factor
        side = facts.size_multiple
        return torch.zeros(spec.n, pipe.vae.config.latent_channels, frames, spec.height // side, spec.width // side)


ADAPTERS = (HunyuanVideo15Adapter(),)
