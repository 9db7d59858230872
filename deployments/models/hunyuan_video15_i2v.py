"""HunyuanVideo 1.5 image-to-video (diffusers ``HunyuanVideo15ImageToVideoPipeline``): text-to-video's
encoders, DiT and VAE (``deployments.models.hunyuan_video15``), plus a reference image that conditions
every step twice.

- The SigLIP image encoder's last hidden states of the image (729 x 1152 on the real one) go into every
  forward as ``image_embeds`` (text-to-video sends zeros there). The image encoder is an encoder: it runs in
  the encoder stage beside the text encoders (``image_encoder`` + ``feature_extractor``), and its states
  travel with the text's (``HunyuanPrompt.image_embeds``).
- The VAE's latents of the image (its mode, scaled) fill the first latent frame of the condition that joins
  the noise on the channel axis, with a mask of that frame (32 + 32 + 1 = 65 input channels). The VAE is
  the decoder stage's, so that runs there (:meth:`HunyuanVideo15I2VAdapter.condition`), as Wan's does.

The pipeline picks the video's size itself: the aspect-ratio bucket nearest the image's at its
transformer's ``target_size``. Here the request's ``size`` is the size (as for every family), and the image
is resized and centre-cropped to it as the pipeline fits it to its bucket; the reference pins the pipeline's
choice to the request's size, and the staged result is that, bit for bit unguided
(tests/deployments/models/test_conformance.py). One video per request, as text-to-video. A transformer
with ``use_meanflow`` (the step-distilled checkpoints) also takes the next step's timestep
(:func:`timestep_r`), per row, as the pipeline passes it.
Run by the stage replicas; :meth:`HunyuanVideo15I2VAdapter.facts` by the ingress (json only).
"""
from __future__ import annotations

import dataclasses
import pathlib

import torch

from deployments.models.adapter import (
    CPU,
    DECODE,
    DENOISE,
    ENCODE,
    FamilyTraits,
    ReferenceImage,
    generator_for,
    read_json,
    reference_image,
)
from deployments.models.hunyuan_video15 import INPUTS, HunyuanPrompt, HunyuanVideo15Adapter, HunyuanVideo15Stepper
from deployments.models.steppers import StepRequest, rows_of
from deployments.models.wan_i2v import with_stand_in_image
from deployments.wire.spec import Family, GenerationSpec, PipelineStage


def cropped_reference(pipe, spec: GenerationSpec):
    """The reference image resized and centre-cropped to the request's size, as the pipeline fits it to its
    size (``video_processor.resize(..., resize_mode="crop")``)."""
    return pipe.video_processor.resize(reference_image(spec), height=spec.height, width=spec.width,
                                       resize_mode="crop")


def timestep_r(request: StepRequest, dtype: torch.dtype) -> torch.Tensor:
    """A mean-flow transformer's second timestep for ``request``'s step, one per row, as the pipeline passes it:
    the next step's timestep, 0 at the last step (the interval the distilled model jumps)."""
    step, timesteps = request.step, request.timesteps
    following = timesteps[step + 1] if step + 1 < len(timesteps) else torch.tensor([0.0], device=timesteps.device)
    return following.expand(request.latents.shape[0]).to(dtype)


class HunyuanVideo15I2VStepper(HunyuanVideo15Stepper):
    """Text-to-video's step with the request's image condition and image embeddings in place of the zeros."""

    family = Family.HUNYUAN_VIDEO15_I2V.value

    def start(self, encoded: HunyuanPrompt, spec, on_step=None) -> StepRequest:
        if encoded.image_condition is None or encoded.image_embeds is None:
            raise ValueError(f"request {spec.request_id}: image-to-video needs the reference image's condition "
                             "(decoder stage) and its image embeddings (encoder stage)")
        request = super().start(encoded, spec, on_step)
        # Per request rows, shared by both guidance branches (the pipeline passes them to both forwards).
        request.cond["image_condition"] = encoded.image_condition.to(self.device, self.dtype)
        request.cond["image_embeds"] = encoded.image_embeds.to(self.device, self.dtype)
        return request

    def condition(self, batch: list[StepRequest], latents: torch.Tensor) -> torch.Tensor:
        return rows_of(batch, "image_condition", "cond")

    def image_embeds(self, batch: list[StepRequest], rows: int) -> torch.Tensor:
        return rows_of(batch, "image_embeds", "cond")

    def extra_inputs(self, batch: list[StepRequest], dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """A ``use_meanflow`` transformer's second timestep, per row: :func:`timestep_r`."""
        if not self.pipe.transformer.config.use_meanflow:
            return {}
        return {"timestep_r": torch.cat([timestep_r(r, dtype) for r in batch])}


class HunyuanVideo15I2VAdapter(HunyuanVideo15Adapter):
    family = Family.HUNYUAN_VIDEO15_I2V
    pipeline_classes = ("HunyuanVideo15ImageToVideoPipeline",)
    stage_modules = {ENCODE: ("text_encoder", "text_encoder_2", "image_encoder"), DENOISE: ("transformer",),
                     DECODE: ("vae",)}
    stage_helpers = {ENCODE: ("tokenizer", "tokenizer_2", "guider", "feature_extractor"),
                     DENOISE: ("scheduler", "guider"), DECODE: ()}
    serves = ("image-to-video",)

    def facts(self, folder, index) -> FamilyTraits:
        return dataclasses.replace(super().facts(folder, index), reference_image=ReferenceImage.REQUIRED)

    @torch.no_grad()
    def encode(self, pipe, facts, spec, device) -> HunyuanPrompt:
        """The text as text-to-video encodes it, and the pipeline's ``encode_image`` of the fitted image
        (SigLIP's last hidden states), one row per video."""
        text = super().encode(pipe, facts, spec, device)
        embeds = pipe.encode_image(image=cropped_reference(pipe, spec), batch_size=spec.n, device=device,
                                   dtype=pipe.image_encoder.dtype)
        return dataclasses.replace(text, image_embeds=embeds.to(CPU))

    @torch.no_grad()
    def condition(self, pipe, facts, spec, device) -> torch.Tensor:
        """``prepare_cond_latents_and_mask`` (diffusers 0.42): the VAE's scaled latents of the fitted image in
        the first latent frame (zeros after), then the mask of that frame, ``spec.n`` rows, on the CPU."""
        from diffusers.pipelines.hunyuan_video1_5.pipeline_hunyuan_video1_5_image2video import retrieve_latents

        vae = pipe.vae
        image = pipe.video_processor.preprocess(cropped_reference(pipe, spec), height=spec.height, width=spec.width)
        latent = retrieve_latents(vae.encode(image.to(device, vae.dtype).unsqueeze(2)), sample_mode="argmax")
        latent = latent * vae.config.scaling_factor
        frames = 1 + (spec.num_frames - 1) // facts.temporal_factor
        condition = latent.repeat(spec.n, 1, frames, 1, 1)
        condition[:, :, 1:] = 0
        mask = torch.zeros(spec.n, 1, frames, *condition.shape[-2:], dtype=condition.dtype, device=condition.device)
        mask[:, :, 0] = 1.0
        return torch.cat([condition, mask], dim=1).to(CPU)

    @torch.no_grad()
    def denoise(self, pipe, facts, encoded, spec, device, on_step=None) -> torch.Tensor:
        """The pipeline's loop for one request, its condition given (the pipeline takes none precomputed):
        each guidance branch its own forward and ClassifierFreeGuidance's sum, as the pipeline runs them."""
        stepper = self.stepper(pipe, facts, device)
        request = stepper.start(encoded.to(device), spec, on_step)
        while not request.done:
            model_input = torch.cat([request.latents, request.cond["image_condition"]], dim=1)
            timestep = request.timesteps[request.step].expand(model_input.shape[0]).to(model_input.dtype)

            extra = stepper.extra_inputs([request], request.latents.dtype)

            def branch(inputs: dict) -> torch.Tensor:
                return pipe.transformer(hidden_states=model_input, image_embeds=request.cond["image_embeds"],
                                        timestep=timestep, return_dict=False,
                                        **{name: inputs[name] for name in INPUTS}, **extra)[0]

            noise = branch(request.cond)
            if request.uncond is not None:
                uncond = branch(request.uncond)
                noise = uncond + spec.guidance_scale * (noise - uncond)
            request.advance(noise)
        return request.latents.to(CPU)

    def stepper(self, pipe, facts, device) -> HunyuanVideo15I2VStepper:
        return HunyuanVideo15I2VStepper(pipe, facts, device)

    def reference_frames(self, pipe, facts, spec) -> torch.Tensor:
        """The pipeline's video of the request's image, its size the request's: the pipeline takes no size, so
        its choice (``video_processor.calculate_default_height_width``, the image's bucket) is pinned to the
        request's for the call; it fits the image to that size itself."""
        guider, processor = pipe.guider, pipe.video_processor
        pipe.guider = guider.new(guidance_scale=spec.guidance_scale)
        processor.calculate_default_height_width = lambda height, width, target_size: (spec.height, spec.width)
        try:
            negative = None if spec.negative_prompt is None else [spec.negative_prompt] * spec.n
            frames = pipe(image=reference_image(spec), prompt=[spec.prompt] * spec.n, negative_prompt=negative,
                          num_frames=spec.num_frames, num_inference_steps=spec.steps,
                          generator=generator_for(spec), output_type="np").frames
        finally:
            pipe.guider = guider
            del processor.calculate_default_height_width  # the class's method again
        return torch.from_numpy(frames)

    def uses_per_request(self, facts, stage, steps, guidance_scale, batched=False) -> dict[str, int]:
        uses = super().uses_per_request(facts, stage, steps, guidance_scale, batched)
        if PipelineStage(stage) is ENCODE:
            return {**uses, "image_encoder": 1}
        return {"vae": 2} if PipelineStage(stage) is DECODE else uses  # encodes the image, decodes the video

    def activation_input(self, pipe, facts, stage, spec):
        if PipelineStage(stage) is ENCODE:
            return with_stand_in_image(spec)  # the encode stage's input is the request, its image included
        value = super().activation_input(pipe, facts, stage, spec)
        if PipelineStage(stage) is not DENOISE:
            return value
        siglip = read_json(pathlib.Path(facts.folder) / "image_encoder" / "config.json")
        tokens = (siglip["image_size"] // siglip["patch_size"]) ** 2  # SigLIP: patches, no class token
        frames = 1 + (spec.num_frames - 1) // facts.temporal_factor
        side = facts.size_multiple
        channels = pipe.transformer.config.in_channels - pipe.transformer.config.out_channels
        return dataclasses.replace(
            value, image_embeds=torch.zeros(spec.n, tokens, siglip["hidden_size"]),
            image_condition=torch.zeros(spec.n, channels, frames, spec.height // side, spec.width // side))


ADAPTERS = (HunyuanVideo15I2VAdapter(),)
