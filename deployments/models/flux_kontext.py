"""FLUX.1 Kontext (diffusers ``FluxKontextPipeline``): FLUX.1's encoders, transformer and VAE, editing an
image by taking it in context.

An edit (``POST /v1/images/edits``) does not noise the image as img2img does: the VAE's latents of it (its
mode), packed as the noise is, follow the noise's tokens in every forward's sequence, with position ids
whose first axis is 1 (the noise's are 0), and the transformer's output for them is dropped. Every step
runs (``EditRule.IN_CONTEXT``: no ``strength``), guidance is FLUX.1's embedding (2.5 is the pipeline's
default), and there is no mask. Without an image it makes an image from text, as FLUX.1 does.

Split over the stages as the image-to-video families are: the decoder stage (it holds the VAE) fits and
encodes the image (:meth:`FluxKontextAdapter.condition`) and the Denoiser packs it beside the noise. The
pipeline fits the image to the trained resolution nearest its aspect ratio (``PREFERRED_KONTEXT_RESOLUTIONS``,
about a megapixel, whatever the output size: 4096 image tokens beside 1024x1024's 4096), so the image costs
as many tokens as a 1024x1024 output; here too. Its output is the request's ``size``: the pipeline is given
``max_area`` = that size's area, which keeps it (its default, 1024^2, would resize every output to a
megapixel). Bitwise the pipeline (tests/deployments/models/test_conformance.py). Requests with images
of other fitted sizes do not share a forward (their sequences differ in length).
Run by the stage replicas; :meth:`FluxKontextAdapter.facts` by the ingress (json only).
"""
from __future__ import annotations

import dataclasses

import torch

from compat.diffusers import encode_vae_image, latent_image_ids, pack_latents
from deployments.models.adapter import CPU, DECODE, FamilyTraits, generator_for, reference_image, upright_size
from deployments.models.flux import FluxAdapter, FluxStepper
from deployments.models.steppers import BatchKey, StepRequest, rows_of, step_alone
from deployments.wire.spec import EditRule, EncodedPrompt, Family, GenerationSpec, PipelineStage

KONTEXT_GUIDANCE = 2.5  # FluxKontextPipeline.__call__'s default
# diffusers' PREFERRED_KONTEXT_RESOLUTIONS (width, height), copied so that the ingress and the activation
# model size a request without importing the pipeline (tests/deployments/models/test_flux_kontext.py
# holds it to diffusers').
PREFERRED_RESOLUTIONS = ((672, 1568), (688, 1504), (720, 1456), (752, 1392), (800, 1328), (832, 1248), (880, 1184),
                         (944, 1104), (1024, 1024), (1104, 944), (1184, 880), (1248, 832), (1328, 800), (1392, 752),
                         (1456, 720), (1504, 688), (1568, 672))


def fitted_size(width: int, height: int, multiple: int) -> tuple[int, int]:
    """(height, width) the pipeline fits an upright image of ``width`` x ``height`` to: its size rounded down
    to ``multiple`` (the image processor's), the preferred resolution nearest that aspect ratio, rounded down
    to ``multiple`` again (``FluxKontextPipeline.__call__`` with ``_auto_resize``)."""
    width, height = width - width % multiple, height - height % multiple
    aspect = width / height
    _, width, height = min((abs(aspect - w / h), w, h) for w, h in PREFERRED_RESOLUTIONS)
    return height // multiple * multiple, width // multiple * multiple


def fitted_image(image: bytes, multiple: int) -> tuple[int, int]:
    """(height, width) the pipeline fits ``image`` to, from its header alone (EXIF's quarter turns included):
    the size the decoder stage encodes it at, and the tokens it adds to the Denoiser's sequence."""
    return fitted_size(*upright_size(image), multiple)


class FluxKontextStepper(FluxStepper):
    """FluxStepper with the image's packed latents after the noise's tokens, and their position ids."""

    family = Family.FLUX_KONTEXT.value

    def noise(self, spec, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        pipe = self.pipe  # FluxKontextPipeline.prepare_latents: the image's latents come with the condition
        latents, _, ids, _ = pipe.prepare_latents(None, spec.n, pipe.transformer.config.in_channels // 4, spec.height,
                                                  spec.width, dtype, self.device, generator_for(spec), None)
        return latents, ids

    def start(self, encoded: EncodedPrompt, spec, on_step=None) -> StepRequest:
        request = super().start(encoded, spec, on_step)
        if encoded.image_condition is None:
            return request  # text to image: FLUX.1's step
        pipe, image = self.pipe, encoded.image_condition.to(self.device, request.latents.dtype)
        n, channels, height, width = image.shape
        request.cond["image_latents"] = pack_latents(pipe, image, n, channels, height, width)
        ids = latent_image_ids(pipe, height // 2, width // 2, self.device, request.latents.dtype)
        ids[..., 0] = 1  # the image's tokens: the noise's ids with the first axis 1
        request.shared = {**request.shared, "img_ids": torch.cat([request.shared["img_ids"], ids], dim=0)}
        # Only requests whose images fit to the same size share a forward: one sequence length, one set of ids.
        request.key = BatchKey(request.key.row_shape + (height, width), request.key.dtype, request.key.text_tokens,
                               request.key.guided)
        return request

    def model_input(self, batch: list[StepRequest], latents: torch.Tensor) -> torch.Tensor:
        if "image_latents" not in batch[0].cond:
            return latents
        return torch.cat([latents, rows_of(batch, "image_latents", "cond")], dim=1)


class FluxKontextAdapter(FluxAdapter):
    family = Family.FLUX_KONTEXT
    pipeline_classes = ("FluxKontextPipeline",)
    edit_pipeline = ""  # not img2img: FluxImg2ImgPipeline's edit is FLUX.1's
    inpaint_pipeline = ""

    def modalities(self, index) -> tuple[str, ...]:
        return ("image", "image-edit")

    def facts(self, folder, index) -> FamilyTraits:
        return dataclasses.replace(super().facts(folder, index), default_guidance=KONTEXT_GUIDANCE,
                                   edit_rule=EditRule.IN_CONTEXT)

    @torch.no_grad()
    def condition(self, pipe, facts, spec: GenerationSpec, device: torch.device) -> torch.Tensor | None:
        """The image fitted as the pipeline fits it, encoded by the VAE (its mode: no draw), shifted and scaled:
        ``spec.n`` rows of unpacked latents, on the CPU; None without an image."""
        if spec.reference_image is None:
            return None
        image = reference_image(spec)
        height, width = fitted_size(*image.size, pipe.vae_scale_factor * 2)
        processor = pipe.image_processor
        pixels = processor.preprocess(processor.resize(image, height, width), height, width)
        latents = encode_vae_image(pipe, pixels.to(device, pipe.vae.dtype))
        return torch.cat([latents] * spec.n, dim=0).to(CPU)

    def context_tokens(self, facts, spec: GenerationSpec) -> int:
        """An edit's image, packed at its fitted size: 4096 tokens for a square one."""
        if spec.reference_image is None:
            return 0
        height, width = fitted_image(spec.reference_image, facts.size_multiple)
        return (height // facts.size_multiple) * (width // facts.size_multiple)

    def condition_shape(self, facts, spec: GenerationSpec) -> GenerationSpec:
        """The encode runs at the image's fitted size, about a megapixel whatever the output's."""
        if spec.reference_image is None:
            return spec
        height, width = fitted_image(spec.reference_image, facts.size_multiple)
        return dataclasses.replace(spec, height=height, width=width)

    def stepper(self, pipe, facts, device) -> FluxKontextStepper:
        return FluxKontextStepper(pipe, facts, device)

    @torch.no_grad()
    def denoise(self, pipe, facts, encoded, spec, device, on_step=None) -> torch.Tensor:
        """One request through the stepper alone (the pipeline takes no precomputed image latents); one
        forward per step, as the pipeline's."""
        stepper = self.stepper(pipe, facts, device)
        return step_alone(stepper, stepper.start(encoded.to(device), spec, on_step)).to(CPU)

    def reference_frames(self, pipe, facts, spec) -> torch.Tensor:
        image = None if spec.reference_image is None else reference_image(spec)
        return torch.from_numpy(pipe(
            image=image, prompt=spec.prompt, height=spec.height, width=spec.width,
            max_area=spec.height * spec.width, num_inference_steps=spec.steps, guidance_scale=spec.guidance_scale,
            num_images_per_prompt=spec.n, generator=generator_for(spec), output_type="np").images).unsqueeze(1)

    def activation_input(self, pipe, facts, stage, spec):
        """With an image to edit, the Denoiser's input carries zero latents at its fitted size: its tokens are
        part of every forward's sequence (the activation model counts them: activation_features)."""
        value = super().activation_input(pipe, facts, stage, spec)
        if PipelineStage(stage) is not PipelineStage.DENOISE or spec.reference_image is None:
            return value
        height, width = fitted_image(spec.reference_image, facts.size_multiple)
        scale = pipe.vae_scale_factor
        latents = torch.zeros(spec.n, pipe.transformer.config.in_channels // 4, height // scale, width // scale)
        return dataclasses.replace(value, image_condition=latents)

    def uses_per_request(self, facts, stage, steps, guidance_scale, batched=False) -> dict[str, int]:
        if PipelineStage(stage) is DECODE:
            return {"vae": 2}  # encodes the image to edit, decodes the result
        return super().uses_per_request(facts, stage, steps, guidance_scale, batched)


ADAPTERS = (FluxKontextAdapter(),)
