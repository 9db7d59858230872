"""The FLUX.1 family (diffusers ``FluxPipeline``): CLIP + T5 encoders, FluxTransformer2DModel, AutoencoderKL.

Images only. Guidance is an embedding of the guidance-distilled transformer (one branch per step),
so there is no negative prompt. The staged split is exact, as Wan's (``deployments.models.wan``).
Run by the stage replicas; :meth:`FluxAdapter.facts` by the ingress (json only).
"""
from __future__ import annotations

import copy

import torch

from compat.diffusers import pack_latents, unpack_latents
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
    step_callback,
)
from deployments.models.steppers import BatchKey, StepRequest, TransformerStepper, cached, rows_of, split_noise
from deployments.wire.spec import EditSource, EncodedPrompt, Family

FLUX_GUIDANCE = 3.5  # FluxPipeline.__call__'s default
TEXT_TOKENS = 512  # encode pads every prompt to max_sequence_length=512


class FluxStepper(TransformerStepper):
    """FluxPipeline's loop (diffusers 0.42), one step for a batch; guidance is an embedding, one branch."""

    family = Family.FLUX.value

    def start(self, encoded, spec, on_step=None) -> StepRequest:
        import numpy as np
        from diffusers.pipelines.flux.pipeline_flux import calculate_shift, retrieve_timesteps

        pipe, device = self.pipe, self.device
        encoded = encoded.to(device)
        dtype = self.dtype  # encode_prompt's dtype when the text encoders are elsewhere
        prompt_embeds = encoded.prompt_embeds.to(dtype)
        latents, image_ids = self.noise(spec, prompt_embeds.dtype)
        scheduler = copy.deepcopy(pipe.scheduler)
        config = scheduler.config
        mu = calculate_shift(latents.shape[1], config.get("base_image_seq_len", 256), config.get("max_image_seq_len", 4096),
                             config.get("base_shift", 0.5), config.get("max_shift", 1.15))
        sigmas = None if getattr(config, "use_flow_sigmas", False) else np.linspace(1.0, 1 / spec.steps, spec.steps)
        timesteps, _ = retrieve_timesteps(scheduler, spec.steps, device, sigmas=sigmas, mu=mu)
        scheduler.set_begin_index(0)
        cond = {"encoder_hidden_states": prompt_embeds, "pooled_projections": encoded.pooled_prompt_embeds.to(dtype)}
        if pipe.transformer.config.guidance_embeds:
            cond["guidance"] = torch.full([spec.n], spec.guidance_scale, device=device, dtype=torch.float32)
        shared = {"txt_ids": torch.zeros(prompt_embeds.shape[1], 3, device=device, dtype=dtype), "img_ids": image_ids}
        key = BatchKey(tuple(latents.shape[1:]), latents.dtype, prompt_embeds.shape[1], False)
        return StepRequest(spec, key, scheduler, timesteps, latents, cond, None, on_step, shared)

    def noise(self, spec, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(the request's packed noise, its tokens' position ids): FluxPipeline.prepare_latents."""
        pipe = self.pipe
        return pipe.prepare_latents(spec.n, pipe.transformer.config.in_channels // 4, spec.height, spec.width, dtype,
                                    self.device, generator_for(spec), None)

    def begin_edit(self, request: StepRequest, source: EditSource) -> None:
        """FluxImg2ImgPipeline's start (FluxInpaintPipeline's too): the image's latents noised to the edit's
        first step, packed; with a mask, the inpaint loop's blend after every step."""
        spec, pipe, dtype = request.spec, self.pipe, request.latents.dtype
        timestep = edits.enter_schedule(request)
        latents, image, noise = edits.noised(request, source, timestep, dtype)

        def pack(t: torch.Tensor) -> torch.Tensor:
            return pack_latents(pipe, t, spec.n, *t.shape[1:])

        request.latents = pack(latents)
        if source.mask is not None:  # FluxInpaintPipeline.prepare_mask_latents: one mask row per channel
            mask = source.mask.to(latents.device, dtype).repeat(spec.n, latents.shape[1], 1, 1)
            edits.inpaint(request, pack(image), pack(noise), pack(mask))

    def forward(self, batch: list[StepRequest]) -> list[torch.Tensor]:
        latents = torch.cat([r.latents for r in batch])
        timestep = torch.cat([r.timesteps[r.step].expand(r.latents.shape[0]) for r in batch]).to(latents.dtype)
        guidance = rows_of(batch, "guidance", "cond") if "guidance" in batch[0].cond else None
        with cached(self.pipe.transformer, batch, guided=False):
            noise = self.pipe.transformer(hidden_states=self.model_input(batch, latents), timestep=timestep / 1000,
                                          guidance=guidance,
                                          pooled_projections=rows_of(batch, "pooled_projections", "cond"),
                                          encoder_hidden_states=rows_of(batch, "encoder_hidden_states", "cond"),
                                          return_dict=False, **batch[0].shared)[0]
        return split_noise(batch, noise[:, :latents.shape[1]])  # the noise's tokens (FLUX.1 Kontext adds others)

    def model_input(self, batch: list[StepRequest], latents: torch.Tensor) -> torch.Tensor:
        """The transformer's token sequence for the batch: FLUX.1's is the noise's tokens alone."""
        return latents


class FluxAdapter(edits.ImageEdits, KLImageAdapter):
    family = Family.FLUX
    pipeline_classes = ("FluxPipeline",)
    edit_pipeline = "FluxImg2ImgPipeline"
    inpaint_pipeline = "FluxInpaintPipeline"
    stage_modules = {ENCODE: ("text_encoder", "text_encoder_2"), DENOISE: ("transformer",), DECODE: ("vae",)}
    stage_helpers = {ENCODE: ("tokenizer", "tokenizer_2"), DENOISE: ("scheduler",), DECODE: ()}

    def facts(self, folder, index) -> FamilyTraits:
        # x2: the transformer packs 2x2 latent patches into one token.
        return FamilyTraits(self.family, str(folder), kl_vae_scale(folder) * 2, 1, False, False, FLUX_GUIDANCE,
                           pipeline_class=index["_class_name"], modalities=self.modalities(index))

    @torch.no_grad()
    def encode(self, pipe, facts, spec, device) -> EncodedPrompt:
        positive, pooled, _text_ids = pipe.encode_prompt(
            prompt=spec.prompt, prompt_2=None, device=device, num_images_per_prompt=spec.n,
            max_sequence_length=TEXT_TOKENS)
        return EncodedPrompt(positive, pooled_prompt_embeds=pooled).to(CPU)

    def denoise(self, pipe, facts, encoded, spec, device, on_step=None) -> torch.Tensor:
        encoded = encoded.to(device)
        out = pipe(prompt_embeds=encoded.prompt_embeds, pooled_prompt_embeds=encoded.pooled_prompt_embeds,
                   height=spec.height, width=spec.width, num_inference_steps=spec.steps,
                   guidance_scale=spec.guidance_scale, generator=generator_for(spec), output_type="latent",
                   num_images_per_prompt=1, callback_on_step_end=step_callback(spec, on_step),
                   callback_on_step_end_tensor_inputs=[])
        return out.images.to(CPU)

    def vae_input(self, pipe, latents, spec, device) -> torch.Tensor:
        vae = pipe.vae  # the tail of FluxPipeline.__call__
        latents = unpack_latents(pipe, latents, spec.height, spec.width)
        return ((latents / vae.config.scaling_factor) + vae.config.shift_factor).to(device)

    def stepper(self, pipe, facts, device) -> FluxStepper:
        return FluxStepper(pipe, facts, device)

    def uses_per_request(self, facts, stage, steps, guidance_scale, batched=False) -> dict[str, int]:
        # Guidance-distilled: one pass per step and one per encoder, whatever the scale.
        return self.uses_by_stage(facts, stage, encode=1, denoise=steps)

    def prompt_input(self, pipe, spec) -> EncodedPrompt:
        config = pipe.transformer.config
        return EncodedPrompt(torch.zeros(spec.n, TEXT_TOKENS, config.joint_attention_dim),
                             pooled_prompt_embeds=torch.zeros(spec.n, config.pooled_projection_dim))

    def latent_input(self, pipe, spec) -> torch.Tensor:
        side = pipe.vae_scale_factor * 2  # Flux packs 2x2 latent patches into one token
        return torch.zeros(spec.n, (spec.height // side) * (spec.width // side), pipe.vae.config.latent_channels * 4)


ADAPTERS = (FluxAdapter(),)
