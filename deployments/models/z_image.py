"""Z-Image (diffusers ``ZImagePipeline``): Qwen3 text model, single-stream S3-DiT, FLUX.1's AutoencoderKL.

Images only. Knobs as the pipeline means them: classifier-free guidance runs when
``guidance_scale > 0`` (not > 1), as ``pos + scale * (pos - neg)`` on the negative prompt ("" when
none); Z-Image-Turbo is meant to run with ``guidance_scale=0`` and 8-9 steps (its card), the base
model with guidance. The encoder returns one embedding per prompt of the prompt's own token count
(padding dropped by its mask), and the transformer takes lists of them: requests with prompts of
different lengths share a forward. The staged split is exact (same seeded generator, same lists).
Run by the stage replicas; :meth:`ZImageAdapter.facts` by the ingress (json only).
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
    step_callback,
)
from deployments.models.steppers import BatchKey, StepRequest, TransformerStepper, uncached
from deployments.wire.prompt_tensors import PromptTensors
from deployments.wire.spec import EditSource, Family

Z_IMAGE_GUIDANCE = 5.0  # ZImagePipeline.__call__'s default (Turbo: 0.0)
TEXT_TOKENS = 512  # the pipeline's max_sequence_length: the encoder's pass is this long whatever the prompt


@dataclass(frozen=True)
class ZImagePrompt(PromptTensors):
    """``ZImagePipeline.encode_prompt``'s lists: one (tokens_i, width) embedding per prompt (one prompt here)."""

    prompt_embeds: tuple[torch.Tensor, ...]
    negative_prompt_embeds: tuple[torch.Tensor, ...] | None = None  # with guidance only


def _guided(spec) -> bool:
    return spec.guidance_scale > 0  # ZImagePipeline.do_classifier_free_guidance


class ZImageStepper(TransformerStepper):
    """ZImagePipeline's loop (diffusers 0.42), one step for a batch of requests (both branches in one call,
    as the pipeline does, positive rows first)."""

    family = Family.Z_IMAGE.value

    def start(self, encoded: ZImagePrompt, spec, on_step=None) -> StepRequest:
        from diffusers.pipelines.z_image.pipeline_z_image import (
            calculate_shift,
            get_default_z_image_sigmas,
            retrieve_timesteps,
        )

        pipe, device = self.pipe, self.device
        encoded = encoded.to(device)
        latents = pipe.prepare_latents(spec.n, pipe.transformer.in_channels, spec.height, spec.width, torch.float32,
                                       device, generator_for(spec), None)
        scheduler = copy.deepcopy(pipe.scheduler)
        config = scheduler.config
        mu = calculate_shift((latents.shape[2] // 2) * (latents.shape[3] // 2), config.get("base_image_seq_len", 256),
                             config.get("max_image_seq_len", 4096), config.get("base_shift", 0.5),
                             config.get("max_shift", 1.15))
        timesteps, _ = retrieve_timesteps(scheduler, spec.steps, device, sigmas=get_default_z_image_sigmas(spec.steps),
                                          mu=mu)
        scheduler.set_begin_index(0)
        # Row i of the request's n: its prompt's embedding (the pipeline repeats the list n times).
        cond = {"captions": [e for e in encoded.prompt_embeds for _ in range(spec.n)]}
        uncond = {"captions": [e for e in encoded.negative_prompt_embeds for _ in range(spec.n)]} if _guided(spec) else None
        # Caption lengths differ per prompt and the transformer takes lists: any lengths share a forward.
        key = BatchKey(tuple(latents.shape[1:]), self.dtype, 0, uncond is not None)
        return StepRequest(spec, key, scheduler, timesteps, latents, cond, uncond, on_step)

    def begin_edit(self, request: StepRequest, source: EditSource) -> None:
        """ZImageImg2ImgPipeline's start (ZImageInpaintPipeline's too): the image's latents noised to the
        edit's first step, in the prompt's dtype (its text-to-image latents are float32; its img2img ones are
        not); with a mask, the inpaint loop's blend after every step."""
        timestep = edits.enter_schedule(request)
        request.latents, image, noise = edits.noised(request, source, timestep, self.dtype)
        if source.mask is not None:  # ZImageInpaintPipeline: one mask channel, broadcast over the latents'
            mask = source.mask.to(image.device, self.dtype).repeat(request.spec.n, 1, 1, 1)
            edits.inpaint(request, image, noise, mask)

    def forward(self, batch: list[StepRequest]) -> list[torch.Tensor]:
        uncached(batch, self.family)
        latents = torch.cat([r.latents for r in batch]).to(self.dtype)
        timestep = torch.cat([(1000 - r.timesteps[r.step].expand(r.latents.shape[0])) / 1000 for r in batch])
        captions = [c for r in batch for c in r.cond["captions"]]
        guided = batch[0].key.guided
        if guided:
            latents, timestep = latents.repeat(2, 1, 1, 1), timestep.repeat(2)
            captions += [c for r in batch for c in r.uncond["captions"]]
        out = self.pipe.transformer(list(latents.unsqueeze(2).unbind(dim=0)), timestep, captions, return_dict=False)[0]
        rows = sum(r.latents.shape[0] for r in batch)
        noise, start = [], 0
        for r in batch:
            n = r.latents.shape[0]
            if guided:  # the pipeline's formula, row by row in float32
                pos = [out[start + j].float() for j in range(n)]
                neg = [out[rows + start + j].float() for j in range(n)]
                pred = torch.stack([p + r.spec.guidance_scale * (p - q) for p, q in zip(pos, neg)], dim=0)
            else:
                pred = torch.stack([out[start + j].float() for j in range(n)], dim=0)
            noise.append(-pred.squeeze(2))  # Z-Image predicts the negated velocity
            start += n
        return noise


class ZImageAdapter(edits.ImageEdits, KLImageAdapter):
    family = Family.Z_IMAGE
    pipeline_classes = ("ZImagePipeline",)
    edit_pipeline = "ZImageImg2ImgPipeline"
    inpaint_pipeline = "ZImageInpaintPipeline"
    stage_modules = {ENCODE: ("text_encoder",), DENOISE: ("transformer",), DECODE: ("vae",)}
    stage_helpers = {ENCODE: ("tokenizer",), DENOISE: ("scheduler",), DECODE: ()}

    def facts(self, folder, index) -> FamilyTraits:
        patch = int(read_json(folder / "transformer" / "config.json").get("all_patch_size", [2])[0])
        # ZImagePipeline.__call__: sides are multiples of vae_scale_factor x 2 (the 2x2 patch).
        return FamilyTraits(self.family, str(folder), kl_vae_scale(folder) * patch, 1, False, True, Z_IMAGE_GUIDANCE,
                           pipeline_class=index["_class_name"], modalities=self.modalities(index))

    @torch.no_grad()
    def encode(self, pipe, facts, spec, device) -> ZImagePrompt:
        positive, negative = pipe.encode_prompt(
            prompt=spec.prompt, device=device, do_classifier_free_guidance=_guided(spec),
            negative_prompt=spec.negative_prompt, max_sequence_length=TEXT_TOKENS)
        return ZImagePrompt(tuple(positive), tuple(negative) if _guided(spec) else None).to(CPU)

    def denoise(self, pipe, facts, encoded, spec, device, on_step=None) -> torch.Tensor:
        encoded = encoded.to(device)
        negative = list(encoded.negative_prompt_embeds) if encoded.negative_prompt_embeds is not None else None
        out = pipe(prompt_embeds=list(encoded.prompt_embeds), negative_prompt_embeds=negative,
                   height=spec.height, width=spec.width, num_inference_steps=spec.steps,
                   guidance_scale=spec.guidance_scale, generator=generator_for(spec), output_type="latent",
                   num_images_per_prompt=spec.n, callback_on_step_end=step_callback(spec, on_step),
                   callback_on_step_end_tensor_inputs=[], max_sequence_length=TEXT_TOKENS)
        return out.images.to(CPU)

    def vae_input(self, pipe, latents, spec, device) -> torch.Tensor:
        vae = pipe.vae  # the tail of ZImagePipeline.__call__
        return (latents.to(device, vae.dtype) / vae.config.scaling_factor) + vae.config.shift_factor

    def stepper(self, pipe, facts, device) -> ZImageStepper:
        return ZImageStepper(pipe, facts, device)

    def uses_per_request(self, facts, stage, steps, guidance_scale, batched=False) -> dict[str, int]:
        # Guided: the encoder runs for the negative prompt too; the pipeline's loop already runs both
        # branches in one transformer call, so a step is one pass either way.
        return self.uses_by_stage(facts, stage, encode=2 if guidance_scale > 0 else 1, denoise=steps)

    def prompt_input(self, pipe, spec) -> ZImagePrompt:
        # The longest caption the encoder gives: the safe side for shorter ones.
        caption = (torch.zeros(TEXT_TOKENS, pipe.transformer.config.cap_feat_dim),)
        return ZImagePrompt(caption, caption if _guided(spec) else None)


ADAPTERS = (ZImageAdapter(),)
