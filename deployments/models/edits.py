"""Image and video edits (``POST /v1/images/edits``; a video's remix or edit): the source, noised to a step of the
schedule, denoised from there.

diffusers' img2img pipelines (``FluxImg2ImgPipeline``, ``StableDiffusion3Img2ImgPipeline``,
``ZImageImg2ImgPipeline``, ``QwenImageImg2ImgPipeline``; for Wan2.1, ``WanVideoToVideoPipeline`` on a
one-frame video, or on a video's frames: :func:`source_frames`) run this in one process; here it splits by
where the weights are:

- the decoder stage (it holds the VAE) resizes and encodes the image, sampling the VAE's latent
  distribution with the request's generator (Wan's pipeline reads its mode: no draw) (:func:`encode_image`),
  and sends the latents with the generator's state after that (:class:`EditSource`, 5 KB beside the latents);
- the Denoiser enters the schedule at the edit's first step (:func:`enter_schedule`; each family's pipeline
  rounds it its own way: ``deployments.wire.spec.EditRule``) and noises the image's
  latents to that step's sigma with the same generator's next draws (:func:`noised`), as the pipeline's
  one generator would; the family packs them as its text-to-image latents are packed.

From there the request is any other in the step batch: each row carries its own timestep. Bitwise each
family's pipeline (Wan guided: within one 8-bit level, as its text-to-video is; tests/deployments/models/
test_edits.py). A family edits by mixing :class:`ImageEdits` into its adapter. Run by the stage replicas.
"""
from __future__ import annotations

import dataclasses
import io
import logging
from typing import Callable, ClassVar

import torch

from deployments.models.adapter import CPU, FamilyTraits, generator_for, pipeline_images, reference_image
from deployments.models.steppers import StepRequest
from deployments.wire import media
from deployments.wire.spec import EditSource, GenerationSpec

# The image's latents from the VAE's sample: the family's shift and scale (a KL VAE's, or Qwen-Image's and
# Wan's per-channel mean and std).
ToLatents = Callable[[object, torch.Tensor], torch.Tensor]

logger = logging.getLogger(__name__)


def kl_latents(vae, sampled: torch.Tensor) -> torch.Tensor:
    """An AutoencoderKL's latents as FLUX.1's, SD3.5's and Z-Image's img2img pipelines scale them."""
    return (sampled - vae.config.shift_factor) * vae.config.scaling_factor


@torch.no_grad()
def encode_image(pipe, spec: GenerationSpec, device: torch.device, image: torch.Tensor,
                 to_latents: ToLatents = kl_latents, sample_mode: str = "sample") -> EditSource:
    """The decoder stage's half: ``image`` (as the family's edit pipeline preprocessed it) encoded by
    the VAE with the request's generator, on the CPU. The image goes in at the VAE's dtype, which is the
    dtype the pipeline casts it to when it is loaded in one. ``sample_mode`` "argmax": the pipeline reads
    the latent distribution's mode and draws nothing (Wan's video-to-video)."""
    from diffusers.pipelines.flux.pipeline_flux_img2img import retrieve_latents

    vae = pipe.vae
    generator = generator_for(spec)
    sampled = retrieve_latents(vae.encode(image.to(device=device, dtype=vae.dtype)), generator=generator,
                               sample_mode=sample_mode)
    return EditSource(to_latents(vae, sampled).to(CPU), generator.get_state())


def enter_schedule(request: StepRequest) -> torch.Tensor:
    """The Denoiser's first half: ``request`` runs the last ``strength`` of its schedule (diffusers'
    ``get_timesteps``); the timestep its image is noised to, one per row."""
    spec, scheduler = request.spec, request.scheduler
    start = spec.edit_start * scheduler.order
    request.timesteps = request.timesteps[start:]
    scheduler.set_begin_index(start)
    logger.info("request %s: an edit at strength %g enters the schedule of %d steps at step %d (sigma %.3f): "
                "%d steps run", spec.request_id, spec.strength, spec.steps, start,
                float(scheduler.sigmas[start]), len(request.timesteps))
    return request.timesteps[:1].repeat(request.latents.shape[0])


def noised(request: StepRequest, source: EditSource, timestep: torch.Tensor, dtype: torch.dtype,
           arrange: Callable[[torch.Tensor], torch.Tensor] | None = None,
           add_noise: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The Denoiser's second half: (the start latents, the image's latents, the noise). The image's latents
    repeated to the request's rows (``arrange``d as the family's pipeline lays them out) and noised to
    ``timestep`` by the scheduler, with noise drawn where the decoder's sampling left the generator.
    Unpacked: the family packs them. ``add_noise``: the scheduler's ``add_noise`` (Wan's UniPC, as
    WanVideoToVideoPipeline calls it), else ``scale_noise`` (the flow-matching Euler schedulers the image
    pipelines call)."""
    from diffusers.utils.torch_utils import randn_tensor

    device, rows = request.latents.device, request.latents.shape[0]
    generator = torch.Generator(device="cpu")
    generator.set_state(source.generator_state)
    image = source.latents.to(device=device, dtype=dtype)
    image = torch.cat([image] * (rows // image.shape[0]), dim=0)
    if arrange is not None:
        image = arrange(image)
    noise = randn_tensor(image.shape, generator=generator, device=device, dtype=dtype)
    if add_noise:
        return request.scheduler.add_noise(image, noise, timestep), image, noise
    return request.scheduler.scale_noise(image, timestep, noise), image, noise


def inpaint(request: StepRequest, image: torch.Tensor, noise: torch.Tensor, mask: torch.Tensor) -> None:
    """An inpainting edit's touch after every step (the inpaint pipelines' loop): outside the mask
    (``mask`` 0) the latents are the image's, noised to the next step's sigma (the image itself after the
    last step); inside, as stepped. A preview's estimate keeps the image outside the mask too, as the final
    latents will. ``image``, ``noise`` and ``mask`` in the request's latent layout."""
    scheduler = request.scheduler

    def blend(latents: torch.Tensor) -> torch.Tensor:
        proper = image
        if not request.done:  # the scheduler's step index is the next step's: its sigma noises the image
            proper = scheduler.scale_noise(image, request.timesteps[request.step].reshape(1), noise)
        return (1 - mask) * proper + mask * latents

    request.blend = blend
    request.keep = lambda estimate: (1 - mask) * image + mask * estimate  # a preview: the image outside the mask


def openai_mask(spec: GenerationSpec):
    """The request's mask as the inpaint pipelines take one (white repaints, black keeps), from OpenAI's
    (fully transparent pixels mark where to edit), upright as the image is."""
    from PIL import Image, ImageOps

    with Image.open(io.BytesIO(spec.mask_image)) as mask:
        alpha = ImageOps.exif_transpose(mask).convert("RGBA").getchannel("A")
    return alpha.point(lambda a: 255 if a == 0 else 0, mode="L")


def source_frames(spec: GenerationSpec) -> list:
    """A video-to-video edit's source as the RGB PIL frames its pipeline is given: the first ``num_frames``
    frames of a video edit's video, decoded and scaled to the edit's size by ffmpeg
    (:func:`deployments.wire.media.video_frames`; a remix's source is already that size), or an image
    edit's image as a video of one frame."""
    from PIL import Image

    if spec.reference_video is None:
        return [reference_image(spec)]
    frames = media.video_frames(spec.reference_video, spec.num_frames, (spec.width, spec.height))
    return [Image.fromarray(frame) for frame in frames]


class ImageEdits:
    """An image family's edits, mixed into its adapter ahead of its base (``class FluxAdapter(ImageEdits,
    KLImageAdapter)``): the decoder stage's :meth:`condition` for an edit, the family's img2img pipeline as
    the bitwise reference, and ``image-edit`` in what ``/v1/models`` says a folder that :meth:`edits` serves.
    The family's stepper implements ``begin_edit(request, source)`` (:func:`enter_schedule`, :func:`noised`, its packing)."""

    edit_pipeline: ClassVar[str] = ""  # the family's diffusers img2img pipeline, on the same folder ("": none)
    to_latents: ClassVar[ToLatents] = staticmethod(kl_latents)
    frame_axis: ClassVar[bool] = False  # its VAE encodes videos (Qwen-Image's): the image is a one-frame one
    sample_mode: ClassVar[str] = "sample"  # how its pipeline reads the VAE's latent distribution
    # The family's diffusers inpaint pipeline ("": no masks): its start is the img2img one's, and its
    # loop puts the image back outside the mask after every step (:func:`inpaint`).
    inpaint_pipeline: ClassVar[str] = ""
    # Its edit pipeline edits videos too (WanVideoToVideoPipeline): a finished video's remix, ``video-edit``.
    edits_videos: ClassVar[bool] = False

    def edits(self, index) -> bool:
        """Whether a folder of this family with ``model_index.json`` ``index`` edits images."""
        return bool(self.edit_pipeline)

    def modalities(self, index) -> tuple[str, ...]:
        edits = self.edits(index)
        return (super().modalities(index) + (("image-edit",) if edits else ())
                + (("image-inpaint",) if edits and self.inpaint_pipeline else ())
                + (("video-edit",) if edits and self.edits_videos else ()))

    def edit_image(self, pipe, spec: GenerationSpec) -> torch.Tensor:
        """The request's image as the family's edit pipeline preprocesses it: resized to the request's
        size by the pipeline's image processor, float32, a batch of one."""
        image = pipe.image_processor.preprocess(reference_image(spec), height=spec.height, width=spec.width)
        image = image.to(dtype=torch.float32)
        return image.unsqueeze(2) if self.frame_axis else image

    def condition(self, pipe, facts: FamilyTraits, spec: GenerationSpec, device: torch.device) -> EditSource | None:
        if spec.strength is None:
            return super().condition(pipe, facts, spec, device)
        source = encode_image(pipe, spec, device, self.edit_image(pipe, spec), self.to_latents, self.sample_mode)
        if spec.mask_image is None:
            return source
        return dataclasses.replace(source, mask=self.edit_mask(pipe, spec))

    def edit_mask(self, pipe, spec: GenerationSpec) -> torch.Tensor:
        """The request's mask as the inpaint pipeline makes it: its mask processor's (resized to the
        request's size, grey, binarised at 0.5), then resized to the latents' size (nearest), on the CPU."""
        processor = self.edit_pipeline_of(pipe, self.inpaint_pipeline).mask_processor
        mask = processor.preprocess(openai_mask(spec), height=spec.height, width=spec.width)
        scale = pipe.vae_scale_factor
        return torch.nn.functional.interpolate(mask, size=(spec.height // scale, spec.width // scale))

    def reference_frames(self, pipe, facts: FamilyTraits, spec: GenerationSpec) -> torch.Tensor:
        if spec.strength is None:
            return super().reference_frames(pipe, facts, spec)
        if spec.mask_image is not None:
            return pipeline_images(self.edit_pipeline_of(pipe, self.inpaint_pipeline), spec, image=reference_image(spec),
                                   mask_image=openai_mask(spec), strength=spec.strength, **self.edit_knobs(pipe, spec))
        return pipeline_images(self.edit_pipeline_of(pipe), spec, image=reference_image(spec), strength=spec.strength,
                               **self.edit_knobs(pipe, spec))

    def edit_pipeline_of(self, pipe, name: str = ""):
        """The family's edit pipeline (or the one ``name``d: its inpaint pipeline) over ``pipe``'s components
        (those it takes: WanPipeline's ``transformer_2`` slot is not WanVideoToVideoPipeline's)."""
        import inspect

        import diffusers

        edit = getattr(diffusers, name or self.edit_pipeline)
        taken = inspect.signature(edit.__init__).parameters
        return edit(**{slot: module for slot, module in pipe.components.items() if slot in taken})

    def edit_knobs(self, pipe, spec: GenerationSpec) -> dict:
        """The img2img pipeline's guidance arguments for ``spec``, as its text-to-image reference passes them."""
        return {"negative_prompt": spec.negative_prompt, "guidance_scale": spec.guidance_scale}
