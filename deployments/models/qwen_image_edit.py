"""Qwen-Image-Edit (diffusers ``QwenImageEditPlusPipeline``: -2509 and -2511; ``QwenImageEditPipeline``: the first):
Qwen-Image's encoder, transformer and VAE, editing an image it sees twice.

An edit (``POST /v1/images/edits``; the family makes no image from text, as its pipelines make none):
- **the prompt sees the image**: Qwen2.5-VL encodes the prompt with the image in it (its vision tower's
  merged patches as ``<|image_pad|>`` tokens, the edit template's "Picture 1:" on the Plus pipeline), fitted to
  384^2 px on the Plus pipeline and to 1024^2 on the first one, at the image's aspect ratio;
- **every step sees the image in context**, as FLUX.1 Kontext: the VAE's latents of it (its mode; 1024^2 px,
  4096 packed tokens, whatever the output's size) follow the noise's tokens in every forward, with their own
  ``img_shapes`` entry, and the transformer's output for them is dropped (``EditRule.IN_CONTEXT``: no
  ``strength``, every step runs, no mask).
Guidance is Qwen-Image's true CFG (``true_cfg_scale`` 4.0 with a negative prompt; the negative prompt sees the
image too). -2511's transformer (``zero_cond_t``) modulates the image's tokens with timestep 0 itself.

Split over the stages as FLUX.1 Kontext is: the encoder stage (it holds Qwen2.5-VL) fits the image for the
vision tower, the decoder stage (the VAE) fits and encodes it for the Denoiser (:meth:`condition`), and the
Denoiser packs it beside the noise. Bitwise the pipeline (tests/deployments/models/test_conformance.py,
test_qwen_image_edit.py). Requests whose images fit to other sizes do not share a forward.

The folder's ``processor`` is transformers' Qwen2VLProcessor, whose video processor needs torchvision; an edit
sends images only, so the encoder stage loads the folder's tokenizer and image processor as
:class:`ImageQwen2VLProcessor` (the same class's text and image path, without a video processor).
Run by the stage replicas; :meth:`QwenImageEditAdapter.facts` by the ingress (json only).
"""
from __future__ import annotations

import dataclasses
import math
import pathlib

import torch

from compat.diffusers import encode_vae_image, pack_latents
from deployments.models.adapter import (
    CPU,
    DECODE,
    DENOISE,
    ENCODE,
    FamilyTraits,
    generator_for,
    reference_image,
    upright_image,
    upright_size,
)
from deployments.models.qwen_image import TEXT_TOKENS, QwenImageAdapter, QwenImagePrompt, QwenImageStepper, true_cfg
from deployments.models.steppers import BatchKey, StepRequest, rows_of, step_alone
from deployments.models.wan_i2v import with_stand_in_image
from deployments.wire.spec import EditRule, Family, GenerationSpec, PipelineStage

# diffusers' CONDITION_IMAGE_SIZE and VAE_IMAGE_SIZE (pipeline_qwenimage_edit_plus), copied so that the ingress
# and the activation model size a request without importing the pipeline (test_qwen_image_edit.py holds them
# to diffusers'). The first pipeline fits the image to VAE_AREA for both.
CONDITION_AREA = 384 * 384
VAE_AREA = 1024 * 1024
PLUS = "QwenImageEditPlusPipeline"


def area_size(area: int, width: int, height: int) -> tuple[int, int]:
    """(height, width): ``area`` px at the image's aspect ratio, each side rounded to 32 (the pipelines'
    ``calculate_dimensions``)."""
    ratio = width / height
    fitted_width = math.sqrt(area * ratio)
    return round(fitted_width / ratio / 32) * 32, round(fitted_width / 32) * 32


def vae_size(image: bytes) -> tuple[int, int]:
    """(height, width) both pipelines encode ``image`` at, from its header alone (EXIF's quarter turns
    included): about a megapixel whatever the output's size."""
    return area_size(VAE_AREA, *upright_size(image))


def fitted_vae_sizes(spec: GenerationSpec) -> tuple[tuple[int, int], ...]:
    """:func:`vae_size` of each of the request's images; a square one's (1024x1024) for a request without one
    (the activation calibration's and ``GET /v1/models``' probes: every edit carries an image)."""
    return tuple(map(vae_size, spec.edit_images)) or (area_size(VAE_AREA, 1, 1),)


@dataclasses.dataclass(frozen=True)
class QwenImageEditPrompt(QwenImagePrompt):
    """Qwen-Image's prompt pairs (the images' tokens inside them), and the images' latents from the decoder
    stage, each normalised by the VAE's mean and std and packed, one after the other: (n, tokens, 64)."""

    image_condition: torch.Tensor | None = None


def image_qwen2vl_processor():
    """transformers' Qwen2VLProcessor without its video processor (which needs torchvision), as a class:
    the same ``__call__`` for text and images, which is all the edit pipelines ask of it."""
    from transformers import ProcessorMixin, Qwen2VLProcessor

    class ImageQwen2VLProcessor(Qwen2VLProcessor):
        def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
            # Qwen2VLProcessor.__init__'s token attributes, then the base without a video processor.
            self.image_token, self.video_token = "<|image_pad|>", "<|video_pad|>"
            self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
            self.video_token_id = tokenizer.convert_tokens_to_ids(self.video_token)
            ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)

    return ImageQwen2VLProcessor


class QwenImageEditStepper(QwenImageStepper):
    """QwenImageStepper with the image's packed latents after the noise's tokens, and their ``img_shapes``."""

    family = Family.QWEN_IMAGE_EDIT.value

    def noise(self, spec, dtype: torch.dtype) -> torch.Tensor:
        pipe = self.pipe  # the edit pipelines' prepare_latents: the image's latents come with the condition
        return pipe.prepare_latents(None, spec.n, pipe.transformer.config.in_channels // 4, spec.height, spec.width,
                                    dtype, self.device, generator_for(spec), None)[0]

    def start(self, encoded: QwenImageEditPrompt, spec, on_step=None) -> StepRequest:
        if encoded.image_condition is None:
            raise ValueError(f"request {spec.request_id}: the {self.family} family edits an image; the Denoiser "
                             "needs its latents from the decoder stage (image_condition)")
        request = super().start(encoded, spec, on_step)
        scale = self.pipe.vae_scale_factor * 2  # one packed token per 16x16 px
        shapes = tuple((1, height // scale, width // scale) for height, width in fitted_vae_sizes(spec))
        image = encoded.image_condition.to(self.device, request.latents.dtype)
        if image.shape[1] != sum(h * w for _, h, w in shapes):
            raise ValueError(f"request {spec.request_id}: image_condition has {image.shape[1]} tokens, its images "
                             f"fit to {shapes}")
        request.cond["image_latents"] = image
        request.shared = {**request.shared, "img_shapes": [*request.shared["img_shapes"], *shapes]}
        # Only requests whose images fit to the same sizes share a forward: one sequence length, one img_shapes.
        request.key = BatchKey(request.key.row_shape + tuple(x for shape in shapes for x in shape), request.key.dtype,
                               request.key.text_tokens, request.key.guided)
        return request

    def model_input(self, batch: list[StepRequest], latents: torch.Tensor) -> torch.Tensor:
        return torch.cat([latents, rows_of(batch, "image_latents", "cond")], dim=1)


class QwenImageEditAdapter(QwenImageAdapter):
    family = Family.QWEN_IMAGE_EDIT
    pipeline_classes = (PLUS, "QwenImageEditPipeline")
    edit_pipeline = ""  # not img2img: QwenImageImg2ImgPipeline's edit is Qwen-Image's
    inpaint_pipeline = ""
    stage_helpers = {ENCODE: ("tokenizer", "processor"), DENOISE: ("scheduler",), DECODE: ()}

    def modalities(self, index) -> tuple[str, ...]:
        return ("image-edit",)  # the pipelines take an image always

    def facts(self, folder, index) -> FamilyTraits:
        # The Plus pipeline composes several images ("Picture 1:", "Picture 2:", ...); Qwen-Image-Edit-2509's
        # card: 1 to 3 work best. The first pipeline's template has one.
        plus = index["_class_name"] == PLUS
        return dataclasses.replace(super().facts(folder, index), edit_rule=EditRule.IN_CONTEXT,
                                   max_images=3 if plus else 1)

    def load_stage_pipeline(self, facts, stage, dtype, loaded=None):
        if "processor" in self.helpers(facts, stage):
            loaded = {**(loaded or {}), "processor": self._processor(facts)}
        return super().load_stage_pipeline(facts, stage, dtype, loaded)

    def load_full_pipeline(self, facts, dtype):
        pipe = self.pipeline_type(facts).from_pretrained(facts.folder, use_safetensors=True, dtype=dtype,
                                                         processor=self._processor(facts))
        pipe.set_progress_bar_config(disable=True)
        return pipe

    @staticmethod
    def _processor(facts):
        return image_qwen2vl_processor().from_pretrained(pathlib.Path(facts.folder) / "processor")

    @torch.no_grad()
    def encode(self, pipe, facts, spec, device) -> QwenImageEditPrompt:
        """The prompt (and the negative one, with true CFG) encoded with the images in it, fitted as the pipeline
        fits them for the vision tower."""
        resize = pipe.image_processor.resize
        if facts.pipeline_class == PLUS:
            shown = [resize(image, *area_size(CONDITION_AREA, *image.size)) for image in map(upright_image, spec.edit_images)]
        else:  # one image, at the VAE's size
            image = reference_image(spec)
            shown = resize(image, *area_size(VAE_AREA, *image.size))

        def encoded(prompt):
            return pipe.encode_prompt(prompt=prompt, image=shown, device=device, num_images_per_prompt=spec.n,
                                      max_sequence_length=TEXT_TOKENS)

        positive, mask = encoded(spec.prompt)
        negative, negative_mask = encoded(spec.negative_prompt) if true_cfg(spec) else (None, None)
        return QwenImageEditPrompt(positive, mask, negative, negative_mask).to(CPU)

    @torch.no_grad()
    def condition(self, pipe, facts, spec: GenerationSpec, device: torch.device) -> torch.Tensor:
        """Each image fitted as the pipeline fits it, encoded by the VAE (its mode: no draw), normalised and
        packed, one after the other: ``spec.n`` rows, on the CPU."""
        processor, packed = pipe.image_processor, []
        for image in map(upright_image, spec.edit_images):
            height, width = area_size(VAE_AREA, *image.size)
            if facts.pipeline_class != PLUS:  # the first pipeline resizes, then preprocesses the resized image
                image = processor.resize(image, height, width)
            pixels = processor.preprocess(image, height, width).unsqueeze(2)
            latents = encode_vae_image(pipe, pixels.to(device, pipe.vae.dtype))  # (1, z, 1, h / 8, w / 8)
            packed.append(pack_latents(pipe, latents, 1, *latents.shape[1:2], *latents.shape[3:]))
        return torch.cat([torch.cat(packed, dim=1)] * spec.n, dim=0).to(CPU)

    def context_tokens(self, facts, spec: GenerationSpec) -> int:
        """The images, packed at their fitted sizes: 4096 tokens for a square one (and for a request without one)."""
        m = facts.size_multiple
        return sum((height // m) * (width // m) for height, width in fitted_vae_sizes(spec))

    def condition_shape(self, facts, spec: GenerationSpec) -> GenerationSpec:
        """The encodes run one image at a time at its fitted size, about a megapixel whatever the output's: the
        largest one's."""
        height, width = max(fitted_vae_sizes(spec), key=lambda size: size[0] * size[1])
        return dataclasses.replace(spec, height=height, width=width)

    def stepper(self, pipe, facts, device) -> QwenImageEditStepper:
        return QwenImageEditStepper(pipe, facts, device)

    @torch.no_grad()
    def denoise(self, pipe, facts, encoded, spec, device, on_step=None) -> torch.Tensor:
        """One request through the stepper alone (the pipelines take no precomputed image latents beside a
        PIL image), guidance's branches as two forwards per step, as the pipeline's."""
        stepper = self.stepper(pipe, facts, device)
        stepper.branches_apart = True
        return step_alone(stepper, stepper.start(encoded.to(device), spec, on_step)).to(CPU)

    def reference_frames(self, pipe, facts, spec) -> torch.Tensor:
        return torch.from_numpy(pipe(
            image=[*map(upright_image, spec.edit_images)] if spec.context_images else reference_image(spec),
            prompt=spec.prompt, height=spec.height, width=spec.width,
            num_inference_steps=spec.steps, num_images_per_prompt=spec.n, generator=generator_for(spec),
            output_type="np", **self.edit_knobs(pipe, spec)).images).unsqueeze(1)

    def activation_input(self, pipe, facts, stage, spec):
        """The encoder's input is the request, its image included (a square stand-in where it has none); the
        Denoiser's carries zero latents of the image at its fitted size (the activation model counts them)."""
        stage = PipelineStage(stage)
        if stage is ENCODE:
            return with_stand_in_image(spec)
        value = super().activation_input(pipe, facts, stage, spec)
        if stage is not DENOISE:
            return value
        latents = torch.zeros(spec.n, self.context_tokens(facts, spec), pipe.transformer.config.in_channels)
        return QwenImageEditPrompt(value.prompt_embeds, value.prompt_embeds_mask, value.negative_prompt_embeds,
                                   value.negative_prompt_embeds_mask, latents)

    def uses_per_request(self, facts, stage, steps, guidance_scale, batched=False) -> dict[str, int]:
        if PipelineStage(stage) is DECODE:
            return {"vae": 2}  # encodes the image to edit, decodes the result
        return super().uses_per_request(facts, stage, steps, guidance_scale, batched)


ADAPTERS = (QwenImageEditAdapter(),)
