"""The family adapter: everything one model family means, declared in one class.

A family module (``deployments/models/<family>.py``) defines ``ADAPTERS``: instances of a
:class:`FamilyAdapter` subclass, each declaring how its folder is recognised (``model_index.json``),
which components each stage loads, the request features it accepts (:class:`FamilyTraits`), how the
encoder encodes, how the Denoiser steps a batch (its stepper), how the decoder decodes, the input
its activation model is calibrated on, the uses per request the planner weighs bytes by, and the
in-process reference the conformance suite compares against. Nothing outside a family's module
branches on the family: callers ask :func:`deployments.models.registry.adapter_for`.

Diffusers and torch only; run by the stage replicas (loading, encode, steps, decode) and by the
ingress (recognition and request features, from the folder's json files: no weights).
"""
from __future__ import annotations

import enum
import io
import json
import logging
import pathlib
from dataclasses import dataclass
from typing import Callable, ClassVar, Mapping

import torch

from deployments.wire.spec import (
    DenoiseProgress,
    EditRule,
    EditSource,
    EncodedPrompt,
    Family,
    GenerationSpec,
    PipelineStage,
)
from offload_core.planner.flow_timesteps import min_steps

logger = logging.getLogger(__name__)

ENCODE, DENOISE, DECODE = PipelineStage.ENCODE, PipelineStage.DENOISE, PipelineStage.DECODE
# Stage outputs cross Ray on the CPU: a CUDA tensor would be rebuilt on the receiver's GPU (the
# ingress has none). The copy back to the device is exact, so results stay bitwise.
CPU = torch.device("cpu")


class UnsupportedModelFolder(ValueError):
    """The configured folder is not a diffusers folder of a supported family (or variant)."""


class ReferenceImage(str, enum.Enum):
    """Whether a request may carry a reference image (``input_reference``)."""

    NONE = "none"  # text-only: a reference image is a 400 naming the field
    REQUIRED = "required"  # image-to-video: a request without one is a 400 naming the field
    # Text- or image-to-video (Wan2.2 TI2V-5B): a video request may carry one; an image request may not.
    OPTIONAL = "optional"


@dataclass(frozen=True)
class FamilyTraits:
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
    # The folder's diffusers pipeline class (model_index.json's _class_name).
    pipeline_class: str = ""
    # What it serves, as /v1/models lists it: "image", "image-edit", "image-inpaint", "video", "video-edit",
    # "image-to-video", "video-extend".
    modalities: tuple[str, ...] = ("image",)
    # The denoiser's transformers: one runs per step (Wan2.2 A14B: high noise, then low noise).
    experts: tuple[str, ...] = ("transformer",)
    reference_image: ReferenceImage = ReferenceImage.NONE
    # Python modules the family's pipeline imports when it runs (diffusers' Wan image-to-video
    # calls ftfy on every prompt): build_app checks them, so a missing one fails the deploy.
    requirements: tuple[str, ...] = ()
    # The most outputs one request may ask for (the ``n`` of a batch the family's VAE can decode);
    # None: only the configured limit. HunyuanVideo 1.5's pipeline fails on a batch of two: 1.
    max_n: int | None = None
    # The folder's scheduler's ``shift_terminal`` (Qwen-Image: 0.02), or None: it decides min_steps.
    shift_terminal: float | None = None
    # Where an image edit enters the schedule (with "image-edit" in ``modalities``): the family's pipeline's rounding.
    edit_rule: EditRule = EditRule.IMG2IMG
    # The most images one edit takes (``image[]``): 1, or a family that composes several in context (Qwen-Image-
    # Edit-2509/2511: 3).
    max_images: int = 1

    @property
    def min_steps(self) -> int:
        """The fewest denoising steps that make a finite schedule (2 with a shift_terminal: flow_timesteps)."""
        return min_steps({"shift_terminal": self.shift_terminal})


def read_json(path: pathlib.Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise UnsupportedModelFolder(f"cannot read {path}: {exc}") from exc


def generator_for(spec: GenerationSpec) -> torch.Generator:
    # A CPU generator on every device: the noise, and so the output, does not depend on the GPU.
    return torch.Generator(device="cpu").manual_seed(spec.seed)


def reference_image(spec: GenerationSpec):
    """The request's reference image as the RGB PIL image the pipeline is given (checked by the ingress),
    turned upright by its EXIF orientation as diffusers' ``load_image`` does: a phone's portrait photo is
    stored landscape with an orientation tag, and would otherwise condition the video on its side."""
    return upright_image(spec.reference_image)


def upright_image(data: bytes):
    """An image's file bytes as the RGB PIL image a pipeline is given, turned upright (:func:`reference_image`)."""
    from PIL import Image, ImageOps

    with Image.open(io.BytesIO(data)) as image:
        return ImageOps.exif_transpose(image).convert("RGB")


EXIF_ORIENTATION, TURNED = 0x0112, frozenset({5, 6, 7, 8})  # orientations stored a quarter turn off upright


def upright_size(image: bytes) -> tuple[int, int]:
    """(width, height) of ``image`` as :func:`reference_image` turns it upright, from its header alone (no
    decode): the size a family that fits the image by its aspect ratio fits it from."""
    from PIL import Image

    with Image.open(io.BytesIO(image)) as opened:
        width, height = opened.size
        if opened.getexif().get(EXIF_ORIENTATION) in TURNED:
            width, height = height, width
    return width, height


def step_callback(spec: GenerationSpec, on_step: Callable[[DenoiseProgress], None] | None):
    """A ``callback_on_step_end`` that reports each finished step."""

    def step_end(_pipe, i, _t, _tensors):
        if on_step is not None:
            on_step(DenoiseProgress(spec.request_id, i + 1, spec.steps))
        return {}

    return step_end


def pipeline_images(pipe, spec: GenerationSpec, **knobs) -> torch.Tensor:
    """An image pipeline's in-process result for ``spec`` as one-frame videos (the bitwise reference);
    ``knobs`` are the family's own (negative prompt, guidance)."""
    return torch.from_numpy(pipe(
        prompt=spec.prompt, height=spec.height, width=spec.width, num_inference_steps=spec.steps,
        num_images_per_prompt=spec.n, generator=generator_for(spec), output_type="np", **knobs).images).unsqueeze(1)


def decoded_images(pipe, latents: torch.Tensor) -> torch.Tensor:
    """The image VAE's decode of final, unscaled latents, post-processed as the pipeline does, as
    one-frame videos."""
    image = pipe.vae.decode(latents, return_dict=False)[0]
    return torch.from_numpy(pipe.image_processor.postprocess(image, output_type="np")).unsqueeze(1)


class FamilyAdapter:
    """One family's declarations and stage calls. Subclasses set the class attributes and implement
    the ``NotImplementedError`` methods; the loading code here is shared."""

    family: ClassVar[Family]
    pipeline_classes: ClassVar[tuple[str, ...]]  # model_index.json _class_name values it serves
    # Module components (the ones offload_core manages) and helpers each stage loads.
    stage_modules: ClassVar[Mapping[PipelineStage, tuple[str, ...]]]
    stage_helpers: ClassVar[Mapping[PipelineStage, tuple[str, ...]]]
    # What the family serves, for /v1/models and the families table (docs/gen_families.py): "image", "video",
    # "image-to-video".
    serves: ClassVar[tuple[str, ...]]
    # The family's published usage decodes tile by tile (deployments/models/vae_tiling.py: vae_tiling auto).
    tiles_vae: ClassVar[bool] = False

    # ---- recognition and request features (the ingress; json only) ----
    def recognises(self, index: Mapping) -> bool:
        return index.get("_class_name") in self.pipeline_classes

    def unsupported_variant(self, index: Mapping, folder: pathlib.Path) -> str | None:
        """Why this adapter cannot serve a folder it recognises (a pipeline variant it does not
        handle), or None."""
        return None

    def modalities(self, index: Mapping) -> tuple[str, ...]:
        """What a folder of this family with ``model_index.json`` ``index`` serves, as ``/v1/models`` lists it.
        A family that makes a video from an image extends one from its last frame (``video-extend``)."""
        return self.serves + (("video-extend",) if "image-to-video" in self.serves else ())

    def facts(self, folder: pathlib.Path, index: Mapping) -> FamilyTraits:
        raise NotImplementedError

    def check_request(self, facts: FamilyTraits, spec: GenerationSpec) -> tuple[str, str] | None:
        """A family-specific fault of ``spec`` as (field, message), or None. The shared checks
        (size multiple, frame rule, reference image presence) are the ingress's."""
        return None

    # ---- loading (the stage replicas) ----
    def modules(self, facts: FamilyTraits, stage: PipelineStage) -> tuple[str, ...]:
        return self.stage_modules[PipelineStage(stage)]

    def helpers(self, facts: FamilyTraits, stage: PipelineStage) -> tuple[str, ...]:
        return self.stage_helpers[PipelineStage(stage)]

    def pipeline_type(self, facts: FamilyTraits):
        import diffusers

        return getattr(diffusers, facts.pipeline_class or self.pipeline_classes[0])

    def load_stage_pipeline(self, facts: FamilyTraits, stage: PipelineStage, dtype: torch.dtype,
                            loaded: Mapping[str, torch.nn.Module] | None = None):
        """The pipeline with only ``stage``'s components loaded (the rest None), safetensors only.

        ``loaded``: components loaded elsewhere (a tensor-parallel rank's slices), used as given."""
        cls = self.pipeline_type(facts)
        keep = set(self.modules(facts, stage)) | set(self.helpers(facts, stage))
        index = read_json(pathlib.Path(facts.folder) / "model_index.json")
        skipped = {name: None for name, spec in index.items()
                   if isinstance(spec, list) and spec[0] is not None and name not in keep}
        pipe = cls.from_pretrained(facts.folder, use_safetensors=True, dtype=dtype, **skipped, **(loaded or {}))
        pipe.set_progress_bar_config(disable=True)
        self.restore_scale_factors(pipe, facts)
        logger.info("stage %s loaded %s from %s: components %s, skipped %s", PipelineStage(stage).value,
                    cls.__name__, facts.folder, sorted(keep), sorted(skipped))
        return pipe

    def load_full_pipeline(self, facts: FamilyTraits, dtype: torch.dtype):
        pipe = self.pipeline_type(facts).from_pretrained(facts.folder, use_safetensors=True, dtype=dtype)
        pipe.set_progress_bar_config(disable=True)
        return pipe

    def restore_scale_factors(self, pipe, facts: FamilyTraits) -> None:
        """Without a VAE the pipelines fall back to default scale factors; set the folder's real ones."""

    # ---- the stages' calls ----
    def encode(self, pipe, facts: FamilyTraits, spec: GenerationSpec, device: torch.device) -> EncodedPrompt:
        raise NotImplementedError

    def condition(self, pipe, facts: FamilyTraits, spec: GenerationSpec,
                  device: torch.device) -> torch.Tensor | EditSource | None:
        """The reference image's conditioning, computed where its weights are (the decoder stage's
        VAE): image-to-video's, or an image edit's start (``deployments.models.edits.ImageEdits``);
        None for a family without one."""
        return None

    def context_tokens(self, facts: FamilyTraits, spec: GenerationSpec) -> int:
        """Tokens the request's image adds to every Denoiser forward beside its latents' own (an edit that takes
        its image in context: FLUX.1 Kontext); the activation model counts them as the latents'. 0 here."""
        return 0

    def text_tokens(self, facts: FamilyTraits, spec: GenerationSpec) -> int:
        """Text tokens a Denoiser forward carries for ``spec`` where they vary per request; the activation model
        counts them as the latents'. 0 here: the family pads every prompt to one length, whose cost the model's
        per-request feature holds. A family with unpadded prompts returns ``spec.text_tokens`` once the
        Denoiser has set it (:meth:`encoded_text_tokens`), and before that its calibration stand-in's count."""
        return 0

    def encoded_text_tokens(self, encoded) -> int | None:
        """The text tokens of an encoded prompt's longest row (a forward pads the others to it), where they
        vary per request; None here (padded to one length)."""
        return None

    def condition_shape(self, facts: FamilyTraits, spec: GenerationSpec) -> GenerationSpec:
        """The request as the decoder stage's activation model sees its :meth:`condition` call: the image
        is encoded at the request's size (a family that fits it to another size says so)."""
        return spec

    def denoise(self, pipe, facts: FamilyTraits, encoded: EncodedPrompt, spec: GenerationSpec,
                device: torch.device, on_step=None) -> torch.Tensor:
        """Latents exactly as ``pipe(..., output_type="latent")`` returns them, on the CPU."""
        raise NotImplementedError

    def decode(self, pipe, facts: FamilyTraits, latents: torch.Tensor, spec: GenerationSpec,
               device: torch.device) -> torch.Tensor:
        """Frames (n, frames, H, W, 3) float32 in [0, 1]: the pipeline's ``output_type="np"`` result."""
        raise NotImplementedError

    def stepper(self, pipe, facts: FamilyTraits, device: torch.device):
        """The Denoiser's half of step batching (``deployments.models.steppers.Stepper``)."""
        raise NotImplementedError

    def reference_frames(self, pipe, facts: FamilyTraits, spec: GenerationSpec) -> torch.Tensor:
        """The in-process pipeline's result for ``spec``, in the decoder's layout (the bitwise reference)."""
        raise NotImplementedError

    # ---- planning ----
    def uses_per_request(self, facts: FamilyTraits, stage: PipelineStage, steps: int, guidance_scale: float,
                         batched: bool = False) -> dict[str, int]:
        """Forward passes per request of each of the stage's components (what the planner weighs bytes by).
        ``batched``: the Denoiser's step batching runs guidance's two branches in one forward."""
        raise NotImplementedError

    def uses_by_stage(self, facts: FamilyTraits, stage: PipelineStage, *, encode: int, denoise: int) -> dict[str, int]:
        """``uses_per_request``'s answer when every component of a stage runs equally often (decode once)."""
        per_stage = {PipelineStage.ENCODE: encode, PipelineStage.DENOISE: denoise, PipelineStage.DECODE: 1}
        return {name: per_stage[PipelineStage(stage)] for name in self.modules(facts, stage)}

    def phases(self, facts: FamilyTraits, stage: PipelineStage) -> tuple[tuple[str, ...], ...]:
        """The stage's components grouped by what runs at once; the planner holds one group's working
        set on the device at a time and the replica switches residency between groups."""
        return (self.modules(facts, stage),)

    def warmup_steps(self, facts: FamilyTraits) -> int:
        """Denoising steps a warm-up call runs so that every denoiser component runs (and is timed)."""
        return 1

    def warmup_prompt(self, facts: FamilyTraits) -> str:
        """The prompt of the warm-up and calibration calls: one that runs every component a prompt can
        make the encoder run (a family whose glyph encoder runs only for quoted text quotes some).
        A component it still leaves unrun is planned from its meta facts and timed on first use."""
        return "warm-up"

    def activation_input(self, pipe, facts: FamilyTraits, stage: PipelineStage, spec: GenerationSpec):
        """A stand-in for the stage's input at ``spec``'s shape (zeros: activations depend on shapes)."""
        raise NotImplementedError


def kl_vae_scale(folder: str | pathlib.Path) -> int:
    """An AutoencoderKL's spatial factor, from its config: 2 ** (levels - 1) (8 for FLUX.1, SD3.5, Z-Image)."""
    vae = read_json(pathlib.Path(folder) / "vae" / "config.json")
    return 2 ** (len(vae["block_out_channels"]) - 1)


class KLImageAdapter(FamilyAdapter):
    """The shared shape of the image families on an AutoencoderKL (FLUX.1, SD3.5, Z-Image): the VAE's
    scale factor from its config, decode = the family pipeline's tail (:meth:`vae_input`) then the VAE
    and the image processor, the pipeline's ``output_type="np"`` images as the reference, and
    activation stand-ins of the latents' shape. A family implements :meth:`vae_input` and
    :meth:`prompt_input` (and :meth:`latent_input` if its latents are packed)."""

    serves = ("image",)

    def restore_scale_factors(self, pipe, facts: FamilyTraits) -> None:
        pipe.vae_scale_factor = kl_vae_scale(facts.folder)

    @torch.no_grad()
    def decode(self, pipe, facts, latents, spec, device) -> torch.Tensor:
        return decoded_images(pipe, self.vae_input(pipe, latents, spec, device))

    def vae_input(self, pipe, latents: torch.Tensor, spec: GenerationSpec, device: torch.device) -> torch.Tensor:
        """The family pipeline's tail before ``vae.decode``: the final latents unscaled, on ``device``,
        with the pipeline's own order of casts and operations (so the result stays bitwise)."""
        raise NotImplementedError

    def reference_frames(self, pipe, facts, spec) -> torch.Tensor:
        return pipeline_images(pipe, spec, negative_prompt=spec.negative_prompt, guidance_scale=spec.guidance_scale)

    def activation_input(self, pipe, facts, stage, spec):
        stage = PipelineStage(stage)
        if stage is ENCODE:
            return None
        return self.prompt_input(pipe, spec) if stage is DENOISE else self.latent_input(pipe, spec)

    def prompt_input(self, pipe, spec: GenerationSpec):
        """Zero embeddings at the shapes the encoder stage sends the Denoiser for ``spec``."""
        raise NotImplementedError

    def latent_input(self, pipe, spec: GenerationSpec) -> torch.Tensor:
        """Zero final latents at ``spec``'s shape, as the Denoiser sends the decoder."""
        scale = pipe.vae_scale_factor
        return torch.zeros(spec.n, pipe.vae.config.latent_channels, spec.height // scale, spec.width // scale)

