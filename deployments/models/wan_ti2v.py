"""Wan2.2 TI2V-5B (a ``WanPipeline`` folder with ``expand_timesteps``): text-to-video, and image-to-video.

Text-to-video is Wan's (``deployments.models.wan``). With a reference image the request runs as
diffusers' ``WanImageToVideoPipeline`` runs this folder (diffusers 0.42.1 loads it with that class):
no image encoder and no extra channels; the VAE's normalised latents of the image (one latent
frame) replace the first latent frame of the transformer's input at every step, that frame's
tokens get timestep 0 (``first_frame_mask`` x t per token), and the final latents get the image's
frame back. The VAE is the decoder stage's, so the image's latents are computed there
(:meth:`WanTI2VAdapter.condition`) and travel to the Denoiser as Wan image-to-video's condition
does. Requests with and without an image share a step's forward (their timesteps are per token
already). Run by the stage replicas; :meth:`WanTI2VAdapter.facts` by the ingress (json only).
"""
from __future__ import annotations

import torch

from deployments.models.adapter import CPU, FamilyTraits, ReferenceImage, generator_for, reference_image
from deployments.models.steppers import StepRequest
from deployments.models.wan import WanAdapter, WanStepper, wan_facts
from deployments.models.wan_i2v import denoise_alone, image_latents
from deployments.wire.spec import EncodedPrompt, Family


def first_frame_mask(latents: torch.Tensor) -> torch.Tensor:
    """WanImageToVideoPipeline.prepare_latents' mask with expand_timesteps: 0 on the first latent frame."""
    mask = torch.ones(1, 1, *latents.shape[2:], dtype=torch.float32, device=latents.device)
    mask[:, :, 0] = 0
    return mask


class WanTI2VStepper(WanStepper):
    """WanStepper, with a request's reference image (when it has one) held in its first latent frame."""

    def attach(self, request: StepRequest, encoded: EncodedPrompt) -> None:
        if encoded.image_condition is None:
            return  # text-to-video
        condition, mask = encoded.image_condition.to(self.device), first_frame_mask(request.latents)
        request.cond["image_condition"], request.cond["first_frame_mask"] = condition, mask
        # After the loop the pipeline puts the image's frame back: (1 - mask) x condition + mask x latents.
        request.finish = lambda latents: (1 - mask) * condition + mask * latents

    def model_input(self, request: StepRequest) -> torch.Tensor:
        if "image_condition" not in request.cond:
            return super().model_input(request)
        mask = request.cond["first_frame_mask"]
        return ((1 - mask) * request.cond["image_condition"] + mask * request.latents).to(self.dtype)

    def timestep(self, request: StepRequest) -> torch.Tensor:
        if "image_condition" not in request.cond:
            return super().timestep(request)
        t, rows = request.timesteps[request.step], request.latents.shape[0]
        return (request.cond["first_frame_mask"][0][0][:, ::2, ::2] * t).flatten().unsqueeze(0).expand(rows, -1)


class WanTI2VAdapter(WanAdapter):
    family = Family.WAN_TI2V
    serves = ("image", "video", "image-to-video")
    edit_pipeline = ""  # no edits: WanVideoToVideoPipeline is text-to-video's

    def recognises(self, index) -> bool:
        return index.get("_class_name") in self.pipeline_classes and bool(index.get("expand_timesteps"))

    def facts(self, folder, index) -> FamilyTraits:
        return wan_facts(self, folder, index, reference_image=ReferenceImage.OPTIONAL)

    @torch.no_grad()
    def condition(self, pipe, facts, spec, device) -> torch.Tensor | None:
        """The image's latents as WanImageToVideoPipeline.prepare_latents makes them with expand_timesteps
        (the image alone, one latent frame); None for a text-to-video request."""
        if spec.reference_image is None:
            return None
        return image_latents(pipe, spec, device, frames=1).to(CPU)

    def denoise(self, pipe, facts, encoded, spec, device, on_step=None) -> torch.Tensor:
        if encoded.image_condition is None:
            return super().denoise(pipe, facts, encoded, spec, device, on_step)
        return denoise_alone(WanTI2VStepper(pipe, facts, device), encoded, spec, on_step)

    def stepper(self, pipe, facts, device) -> WanTI2VStepper:
        return WanTI2VStepper(pipe, facts, device)

    def reference_frames(self, pipe, facts, spec) -> torch.Tensor:
        if spec.reference_image is None:
            return super().reference_frames(pipe, facts, spec)
        from diffusers import WanImageToVideoPipeline

        # The same modules in diffusers' image-to-video pipeline (what from_pretrained with that class loads).
        i2v = WanImageToVideoPipeline(**pipe.components, boundary_ratio=pipe.config.boundary_ratio,
                                      expand_timesteps=pipe.config.expand_timesteps)
        i2v.set_progress_bar_config(disable=True)
        return torch.from_numpy(i2v(
            image=reference_image(spec), prompt=spec.prompt, negative_prompt=spec.negative_prompt,
            height=spec.height, width=spec.width, num_frames=spec.num_frames, num_inference_steps=spec.steps,
            guidance_scale=spec.guidance_scale, num_videos_per_prompt=spec.n, generator=generator_for(spec),
            output_type="np").frames)


ADAPTERS = (WanTI2VAdapter(),)
