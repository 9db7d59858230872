"""Wan image-to-video (diffusers ``WanImageToVideoPipeline``): the Wan2.2 I2V-A14B and Wan2.1 I2V layouts.

A reference image conditions every step: the VAE encodes it (first frame, zeros after) into
latents that, with a mask of the given frames, join the noise on the channel axis (16 + 4 + 16 =
36 transformer input channels). The VAE is the decoder stage's, so the conditioning runs there
(:meth:`WanI2VAdapter.condition`) and travels to the Denoiser with the text embeddings: no stage
loads a component twice. Wan2.2 I2V-A14B: two experts switch at ``boundary_ratio`` (0.9), as in
text-to-video, and there is no image encoder.

Wan2.1 I2V (480P/720P, :class:`Wan21I2VAdapter`) also has a CLIP image encoder: its penultimate
hidden states of the reference image (257 x 1280 on the 14B) are prepended to the text in every
block's cross-attention (its own key/value projections). The image encoder is an encoder: it runs
in the encoder stage beside the text encoder (``image_encoder`` + ``image_processor``), and its
embeddings travel with the text's (``EncodedPrompt.image_embeds``). diffusers 0.42.1's pipeline
repeats them once per prompt, not per video, so ``num_videos_per_prompt`` = 2 fails inside the
transformer (a batch of 1 image row against 2 text rows): the family makes one video per request.

Refused with a message: a WanImageToVideoPipeline folder with ``expand_timesteps`` (the TI2V-5B
image conditioning is served from its own ``WanPipeline`` folder by ``deployments.models.wan_ti2v``).
diffusers' I2V pipeline calls ``ftfy`` on every prompt, so the family requires it.
Run by the stage replicas; :meth:`WanI2VAdapter.facts` by the ingress (json only).
"""
from __future__ import annotations

import dataclasses
import io
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
from deployments.models.steppers import StepRequest, rows_of
from deployments.models.wan import (
    WanAdapter,
    WanStepper,
    expert_for,
    wan_facts,
    wan_frames,
)
from deployments.wire.spec import EncodedPrompt, Family, GenerationSpec, PipelineStage


def with_stand_in_image(spec: GenerationSpec) -> GenerationSpec:
    """``spec`` with a grey reference image of its size when it has none: the warm-up's and the
    activation calibration's shapes carry no image, and the image encoder's work depends on none of
    its values (the processor resizes every image to the encoder's side)."""
    if spec.reference_image is not None:
        return spec
    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (spec.width, spec.height), (128, 128, 128)).save(out, format="PNG")
    return dataclasses.replace(spec, reference_image=out.getvalue())


@torch.no_grad()
def image_latents(pipe, spec: GenerationSpec, device: torch.device, frames: int) -> torch.Tensor:
    """The VAE's normalised latents of the reference image as the first of ``frames`` (zeros after),
    ``spec.n`` rows, float32: WanImageToVideoPipeline.prepare_latents' ``latent_condition``."""
    from diffusers.pipelines.wan.pipeline_wan_i2v import retrieve_latents

    vae = pipe.vae
    image = pipe.video_processor.preprocess(reference_image(spec), height=spec.height, width=spec.width)
    image = image.to(device, dtype=torch.float32).unsqueeze(2)
    video = torch.cat([image, image.new_zeros(image.shape[0], image.shape[1], frames - 1, spec.height, spec.width)],
                      dim=2).to(device=device, dtype=vae.dtype)
    latent = retrieve_latents(vae.encode(video), sample_mode="argmax").repeat(spec.n, 1, 1, 1, 1)
    latent = latent.to(device=device, dtype=torch.float32)
    mean = torch.tensor(vae.config.latents_mean).view(1, vae.config.z_dim, 1, 1, 1).to(device, torch.float32)
    inv_std = 1.0 / torch.tensor(vae.config.latents_std).view(1, vae.config.z_dim, 1, 1, 1).to(device, torch.float32)
    return (latent - mean) * inv_std


@torch.no_grad()
def denoise_alone(stepper: WanStepper, encoded: EncodedPrompt, spec: GenerationSpec, on_step=None) -> torch.Tensor:
    """WanImageToVideoPipeline's loop for one request (cond and uncond as separate forwards, as it
    runs them), its condition given: the latents ``pipe(..., output_type="latent")`` returns."""
    pipe = stepper.pipe
    request = stepper.start(encoded, spec, on_step)
    while not request.done:
        t = request.timesteps[request.step]
        model = getattr(pipe, expert_for(pipe, t))
        x, timestep = stepper.model_input(request), stepper.timestep(request)
        image = stepper.image_inputs([request], guided=False)
        noise = model(hidden_states=x, timestep=timestep, encoder_hidden_states=request.cond["encoder_hidden_states"],
                      return_dict=False, **image)[0]
        if request.uncond is not None:
            uncond = model(hidden_states=x, timestep=timestep,
                           encoder_hidden_states=request.uncond["encoder_hidden_states"], return_dict=False,
                           **image)[0]
            noise = uncond + spec.guidance_scale * (noise - uncond)
        request.advance(noise)
    return request.latents.to(CPU)


class WanI2VStepper(WanStepper):
    """WanStepper with the image condition joined to each request's latents on the channel axis."""

    def initial_latents(self, encoded: EncodedPrompt, spec: GenerationSpec) -> torch.Tensor:
        from diffusers.utils.torch_utils import randn_tensor

        pipe, frames = self.pipe, wan_frames(self.pipe, spec)
        shape = (spec.n, getattr(pipe, self.experts[0]).config.out_channels,
                 (frames - 1) // pipe.vae_scale_factor_temporal + 1,
                 spec.height // pipe.vae_scale_factor_spatial, spec.width // pipe.vae_scale_factor_spatial)
        return randn_tensor(shape, generator=generator_for(spec), device=self.device, dtype=torch.float32)

    def attach(self, request: StepRequest, encoded: EncodedPrompt) -> None:
        if encoded.image_condition is None:
            raise ValueError(f"request {request.spec.request_id}: image-to-video needs the reference image's condition")
        # Per request rows, used by both guidance branches (they share the model input).
        request.cond["image_condition"] = encoded.image_condition.to(self.device)
        if getattr(self.pipe, self.experts[0]).config.image_dim is not None:  # Wan2.1: CLIP's embeddings too
            if encoded.image_embeds is None:
                raise ValueError(f"request {request.spec.request_id}: this transformer attends to the reference "
                                 "image's CLIP embeddings, which the encoder stage did not send")
            # WanImageToVideoPipeline casts them to the transformer's dtype, as the text.
            request.cond["encoder_hidden_states_image"] = encoded.image_embeds.to(self.device, self.dtype)

    def image_inputs(self, batch: list[StepRequest], guided: bool) -> dict[str, torch.Tensor]:
        if "encoder_hidden_states_image" not in batch[0].cond:
            return {}
        image = rows_of(batch, "encoder_hidden_states_image", "cond")
        # Both guidance branches attend to the same image (the pipeline passes it to both forwards).
        return {"encoder_hidden_states_image": torch.cat([image, image]) if guided else image}

    def model_input(self, request: StepRequest) -> torch.Tensor:
        return torch.cat([request.latents, request.cond["image_condition"]], dim=1).to(self.dtype)


def has_image_encoder(index) -> bool:
    encoder = index.get("image_encoder")
    return isinstance(encoder, list) and encoder[0] is not None


class WanI2VAdapter(WanAdapter):
    family = Family.WAN_I2V
    pipeline_classes = ("WanImageToVideoPipeline",)
    stage_modules = {ENCODE: ("text_encoder",), DENOISE: ("transformer",), DECODE: ("vae",)}
    stage_helpers = {ENCODE: ("tokenizer",), DENOISE: ("scheduler",), DECODE: ()}
    serves = ("image-to-video",)
    edit_pipeline = ""  # no edits: WanVideoToVideoPipeline is text-to-video's

    def recognises(self, index) -> bool:
        return index.get("_class_name") in self.pipeline_classes and not has_image_encoder(index)

    def unsupported_variant(self, index, folder) -> str | None:
        if index.get("expand_timesteps"):
            return "WanImageToVideoPipeline with expand_timesteps (TI2V-5B image conditioning) is not handled"
        return None

    def facts(self, folder, index) -> FamilyTraits:
        return wan_facts(self, folder, index, reference_image=ReferenceImage.REQUIRED, requirements=("ftfy",))

    @torch.no_grad()
    def condition(self, pipe, facts, spec, device) -> torch.Tensor:
        """WanImageToVideoPipeline.prepare_latents' condition (diffusers 0.42), without the noise:
        mask of the given frame + the VAE's latents of the image followed by zero frames."""
        frames = wan_frames(pipe, spec)
        latent = image_latents(pipe, spec, device, frames)
        factor, (h, w) = pipe.vae_scale_factor_temporal, latent.shape[-2:]
        mask = torch.ones(spec.n, 1, frames, h, w)
        mask[:, :, list(range(1, frames))] = 0
        first = torch.repeat_interleave(mask[:, :, 0:1], dim=2, repeats=factor)
        mask = torch.concat([first, mask[:, :, 1:, :]], dim=2).view(spec.n, -1, factor, h, w).transpose(1, 2)
        return torch.concat([mask.to(latent.device), latent], dim=1).to(CPU)

    def denoise(self, pipe, facts, encoded, spec, device, on_step=None) -> torch.Tensor:
        return denoise_alone(WanI2VStepper(pipe, facts, device), encoded, spec, on_step)

    def stepper(self, pipe, facts, device) -> WanI2VStepper:
        return WanI2VStepper(pipe, facts, device)

    def reference_frames(self, pipe, facts, spec) -> torch.Tensor:
        return torch.from_numpy(pipe(
            image=reference_image(spec), prompt=spec.prompt, negative_prompt=spec.negative_prompt,
            height=spec.height, width=spec.width, num_frames=spec.num_frames, num_inference_steps=spec.steps,
            guidance_scale=spec.guidance_scale, num_videos_per_prompt=spec.n, generator=generator_for(spec),
            output_type="np").frames)

    def uses_per_request(self, facts, stage, steps, guidance_scale, batched=False) -> dict[str, int]:
        if PipelineStage(stage) is DECODE:
            return {"vae": 2}  # encodes the reference image, decodes the video
        return super().uses_per_request(facts, stage, steps, guidance_scale, batched)

    def activation_input(self, pipe, facts, stage, spec):
        value = super().activation_input(pipe, facts, stage, spec)
        if PipelineStage(stage) is not DENOISE:
            return value
        model = getattr(pipe, facts.experts[0]).config
        frames = 1 + (spec.num_frames - 1) // facts.temporal_factor
        scale = pipe.vae_scale_factor_spatial
        condition = torch.zeros(spec.n, model.in_channels - model.out_channels, frames, spec.height // scale,
                                spec.width // scale)
        return EncodedPrompt(value.prompt_embeds, value.negative_prompt_embeds, image_condition=condition)


class Wan21I2VAdapter(WanI2VAdapter):
    """The Wan2.1 I2V layout: WanI2VAdapter plus the CLIP image encoder, in the encoder stage."""

    family = Family.WAN21_I2V
    stage_modules = {ENCODE: ("text_encoder", "image_encoder"), DENOISE: ("transformer",), DECODE: ("vae",)}
    stage_helpers = {ENCODE: ("tokenizer", "image_processor"), DENOISE: ("scheduler",), DECODE: ()}

    def recognises(self, index) -> bool:
        return index.get("_class_name") in self.pipeline_classes and has_image_encoder(index)

    def facts(self, folder, index) -> FamilyTraits:
        # One video per request: diffusers 0.42.1 repeats the image embeddings per prompt, not per video.
        return wan_facts(self, folder, index, reference_image=ReferenceImage.REQUIRED, requirements=("ftfy",),
                         max_n=1)

    @torch.no_grad()
    def encode(self, pipe, facts, spec, device) -> EncodedPrompt:
        """The text as Wan encodes it, and WanImageToVideoPipeline.encode_image's embeddings of the
        reference image (CLIP's penultimate hidden states), one row per output."""
        text = super().encode(pipe, facts, spec, device)
        image = pipe.encode_image(reference_image(spec), device).repeat(spec.n, 1, 1)
        return dataclasses.replace(text, image_embeds=image.to(CPU))

    def uses_per_request(self, facts, stage, steps, guidance_scale, batched=False) -> dict[str, int]:
        uses = super().uses_per_request(facts, stage, steps, guidance_scale, batched)
        return {**uses, "image_encoder": 1} if PipelineStage(stage) is ENCODE else uses

    def activation_input(self, pipe, facts, stage, spec):
        if PipelineStage(stage) is ENCODE:
            return with_stand_in_image(spec)  # the encode stage's input is the request, its image included
        value = super().activation_input(pipe, facts, stage, spec)
        if PipelineStage(stage) is not DENOISE:
            return value
        clip = read_json(pathlib.Path(facts.folder) / "image_encoder" / "config.json")
        tokens = (clip["image_size"] // clip["patch_size"]) ** 2 + 1  # patches + the class token
        return dataclasses.replace(value, image_embeds=torch.zeros(spec.n, tokens, clip["hidden_size"]))


ADAPTERS = (WanI2VAdapter(), Wan21I2VAdapter())
