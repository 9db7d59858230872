"""Stable Diffusion 3.5 (diffusers ``StableDiffusion3Pipeline``): CLIP-L + CLIP-G + T5-XXL, SD3 MMDiT, AutoencoderKL.

Images only. Classifier-free guidance as the pipeline means it: ``guidance_scale > 1`` runs an
unconditional branch on the negative prompt ("" when none), both branches in one transformer
forward, unconditional rows first. The encoder stage holds all three text encoders (T5-XXL's
32128 x 4096 table is most of their 9.4 GiB at bf16: a natural one to stream). The staged split
is exact: the Denoiser runs the pipeline with ``prompt_embeds=...`` and the same seeded generator.
Run by the stage replicas; :meth:`SD3Adapter.facts` by the ingress (json only).
"""
from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from deployments.models import edits
from deployments.models.adapter import (
    CPU,
    DECODE,
    DENOISE,
    ENCODE,
    FamilyTraits,
    KLImageAdapter,
    generator_for,
    kl_vae_scale,
    read_json,
    reference_image,
    step_callback,
)
from deployments.models.step_cache import BlockForm, BlockOutput
from deployments.models.steppers import (
    BatchKey,
    StepRequest,
    TransformerStepper,
    cached,
    guided_noise,
    rows_of,
    split_noise,
)
from deployments.wire.prompt_tensors import PromptTensors
from deployments.wire.spec import EditSource, Family

SD3_GUIDANCE = 7.0  # StableDiffusion3Pipeline.__call__'s default (SD3.5 Large's card suggests 3.5)
T5_TOKENS = 256  # the pipeline's max_sequence_length default
CLIP_TOKENS = 77
# JointTransformerBlock returns (encoder, hidden); the last one (context_pre_only) (None, hidden).
SD3_BLOCKS = BlockForm(BlockOutput.ENCODER_HIDDEN)


@dataclass(frozen=True)
class SD3Prompt(PromptTensors):
    """``StableDiffusion3Pipeline.encode_prompt``'s four tensors: (n, 77 + 256, 4096) and (n, 2048) pooled."""

    prompt_embeds: torch.Tensor
    pooled_prompt_embeds: torch.Tensor
    negative_prompt_embeds: torch.Tensor | None = None  # with guidance only
    negative_pooled_prompt_embeds: torch.Tensor | None = None


def _guided(spec) -> bool:
    return spec.guidance_scale > 1.0  # StableDiffusion3Pipeline.do_classifier_free_guidance


class SD3Stepper(TransformerStepper):
    """StableDiffusion3Pipeline's loop (diffusers 0.42), one step for a batch of requests."""

    family = Family.SD3.value

    def start(self, encoded: SD3Prompt, spec, on_step=None) -> StepRequest:
        from diffusers.pipelines.stable_diffusion_3.pipeline_stable_diffusion_3 import (
            calculate_shift,
            retrieve_timesteps,
        )

        pipe, device, dtype = self.pipe, self.device, self.dtype
        encoded = encoded.to(device)
        latents = pipe.prepare_latents(spec.n, pipe.transformer.config.in_channels, spec.height, spec.width, dtype,
                                       device, generator_for(spec), None)
        scheduler = copy.deepcopy(pipe.scheduler)
        config, kwargs = scheduler.config, {}
        if config.get("use_dynamic_shifting", None):
            patch = pipe.transformer.config.patch_size
            kwargs["mu"] = calculate_shift((latents.shape[2] // patch) * (latents.shape[3] // patch),
                                           config.get("base_image_seq_len", 256), config.get("max_image_seq_len", 4096),
                                           config.get("base_shift", 0.5), config.get("max_shift", 1.16))
        timesteps, _ = retrieve_timesteps(scheduler, spec.steps, device, **kwargs)
        cond = {"encoder_hidden_states": encoded.prompt_embeds.to(dtype),
                "pooled_projections": encoded.pooled_prompt_embeds.to(dtype)}
        uncond = None
        if _guided(spec):
            uncond = {"encoder_hidden_states": encoded.negative_prompt_embeds.to(dtype),
                      "pooled_projections": encoded.negative_pooled_prompt_embeds.to(dtype)}
        key = BatchKey(tuple(latents.shape[1:]), dtype, cond["encoder_hidden_states"].shape[1], uncond is not None)
        return StepRequest(spec, key, scheduler, timesteps, latents, cond, uncond, on_step)

    def begin_edit(self, request: StepRequest, source: EditSource) -> None:
        """StableDiffusion3Img2ImgPipeline's start (StableDiffusion3InpaintPipeline's too): the image's latents
        noised to the edit's first step; with a mask, the inpaint loop's blend after every step."""
        timestep = edits.enter_schedule(request)
        request.latents, image, noise = edits.noised(request, source, timestep, request.latents.dtype)
        if source.mask is not None:  # one mask channel, broadcast over the 16 latent ones
            mask = source.mask.to(image.device, image.dtype).repeat(request.spec.n, 1, 1, 1)
            # The inpaint pipeline repeats the image's latents (contiguous) where img2img concatenates them
            # (the VAE sample's strides); the final latents take its layout, and the decode's convolutions
            # round by layout (7e-7 apart on the tiny zoo).
            edits.inpaint(request, image.contiguous(), noise, mask)

    def forward(self, batch: list[StepRequest]) -> list[torch.Tensor]:
        latents = torch.cat([r.latents for r in batch])
        timestep = torch.cat([r.timesteps[r.step].expand(r.latents.shape[0]) for r in batch])
        text, pooled = rows_of(batch, "encoder_hidden_states", "cond"), rows_of(batch, "pooled_projections", "cond")
        guided = batch[0].key.guided
        if guided:  # the pipeline's order: unconditional rows first, one forward for both branches
            latents, timestep = torch.cat([latents, latents]), torch.cat([timestep, timestep])
            text = torch.cat([rows_of(batch, "encoder_hidden_states", "uncond"), text])
            pooled = torch.cat([rows_of(batch, "pooled_projections", "uncond"), pooled])
        with cached(self.pipe.transformer, batch, guided, SD3_BLOCKS):
            noise = self.pipe.transformer(hidden_states=latents, timestep=timestep, encoder_hidden_states=text,
                                          pooled_projections=pooled, return_dict=False)[0]
        if guided:
            uncond, cond = noise.chunk(2)
            return guided_noise(batch, cond, uncond)
        return split_noise(batch, noise)


class SD3Adapter(edits.ImageEdits, KLImageAdapter):
    family = Family.SD3
    pipeline_classes = ("StableDiffusion3Pipeline",)
    edit_pipeline = "StableDiffusion3Img2ImgPipeline"
    # Its 16-channel branch (SD3.5's transformers): the image put back outside the mask after every step.
    inpaint_pipeline = "StableDiffusion3InpaintPipeline"
    stage_modules = {ENCODE: ("text_encoder", "text_encoder_2", "text_encoder_3"), DENOISE: ("transformer",),
                     DECODE: ("vae",)}
    stage_helpers = {ENCODE: ("tokenizer", "tokenizer_2", "tokenizer_3"), DENOISE: ("scheduler",), DECODE: ()}

    def facts(self, folder, index) -> FamilyTraits:
        patch = int(read_json(folder / "transformer" / "config.json").get("patch_size", 2))
        # StableDiffusion3Pipeline.check_inputs: sides are multiples of vae_scale_factor x patch_size.
        return FamilyTraits(self.family, str(folder), kl_vae_scale(folder) * patch, 1, False, True, SD3_GUIDANCE,
                           pipeline_class=index["_class_name"], modalities=self.modalities(index))

    @torch.no_grad()
    def encode(self, pipe, facts, spec, device) -> SD3Prompt:
        positive, negative, pooled, negative_pooled = pipe.encode_prompt(
            prompt=spec.prompt, prompt_2=None, prompt_3=None, negative_prompt=spec.negative_prompt, device=device,
            num_images_per_prompt=spec.n, do_classifier_free_guidance=_guided(spec), max_sequence_length=T5_TOKENS)
        return SD3Prompt(positive, pooled, negative, negative_pooled).to(CPU)

    def denoise(self, pipe, facts, encoded, spec, device, on_step=None) -> torch.Tensor:
        encoded = encoded.to(device)
        out = pipe(prompt_embeds=encoded.prompt_embeds, pooled_prompt_embeds=encoded.pooled_prompt_embeds,
                   negative_prompt_embeds=encoded.negative_prompt_embeds,
                   negative_pooled_prompt_embeds=encoded.negative_pooled_prompt_embeds,
                   height=spec.height, width=spec.width, num_inference_steps=spec.steps,
                   guidance_scale=spec.guidance_scale, generator=generator_for(spec), output_type="latent",
                   num_images_per_prompt=1, callback_on_step_end=step_callback(spec, on_step),
                   callback_on_step_end_tensor_inputs=[])
        return out.images.to(CPU)

    def vae_input(self, pipe, latents, spec, device) -> torch.Tensor:
        vae = pipe.vae  # the tail of StableDiffusion3Pipeline.__call__
        return (latents.to(device) / vae.config.scaling_factor) + vae.config.shift_factor

    def reference_frames(self, pipe, facts, spec) -> torch.Tensor:
        """With a mask: StableDiffusion3InpaintPipeline's latents, decoded as StableDiffusion3Pipeline (and
        its img2img) decode. The inpaint pipeline's own decode leaves out the VAE's ``shift_factor`` (0.0609
        on SD3.5) that its encode subtracts (diffusers 0.42; huggingface/diffusers#13611, finding 1), so its
        images are off in colour, outside the mask too; the service decodes every SD3.5 image one way."""
        if spec.strength is None or spec.mask_image is None:
            return super().reference_frames(pipe, facts, spec)
        latents = self.edit_pipeline_of(pipe, self.inpaint_pipeline)(
            prompt=spec.prompt, image=reference_image(spec), mask_image=edits.openai_mask(spec),
            strength=spec.strength, height=spec.height, width=spec.width, num_inference_steps=spec.steps,
            num_images_per_prompt=spec.n, generator=generator_for(spec), output_type="latent",
            **self.edit_knobs(pipe, spec)).images
        return self.decode(pipe, facts, latents, spec, CPU)

    def stepper(self, pipe, facts, device) -> SD3Stepper:
        return SD3Stepper(pipe, facts, device)

    def uses_per_request(self, facts, stage, steps, guidance_scale, batched=False) -> dict[str, int]:
        # Guided: each encoder runs for the prompt and the negative prompt; the pipeline's own loop
        # already runs both branches in one transformer forward, so a step is one pass either way.
        return self.uses_by_stage(facts, stage, encode=2 if guidance_scale > 1.0 else 1, denoise=steps)

    def prompt_input(self, pipe, spec) -> SD3Prompt:
        config, n = pipe.transformer.config, spec.n
        embeds = torch.zeros(n, CLIP_TOKENS + T5_TOKENS, config.joint_attention_dim)
        pooled = torch.zeros(n, config.pooled_projection_dim)
        if _guided(spec):
            return SD3Prompt(embeds, pooled, embeds.clone(), pooled.clone())
        return SD3Prompt(embeds, pooled)


ADAPTERS = (SD3Adapter(),)
