"""What travels between the ingress and the stage replicas: frozen, typed, tensors as tensors.

These objects cross Ray's object store (pickled, with tensors serialized as tensors), so the
stages never see JSON and the ingress never sees model internals.
"""
from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass

import torch


class Family(enum.Enum):
    # diffusers WanPipeline: UMT5 encoder, WanTransformer3DModel, AutoencoderKLWan. An image is a
    # video of one frame.
    WAN = "wan"
    # diffusers FluxPipeline: CLIP + T5 encoders, FluxTransformer2DModel, AutoencoderKL. Images only.
    FLUX = "flux"
    # diffusers WanImageToVideoPipeline (Wan2.2 I2V-A14B layout): a reference image in, a video out.
    WAN_I2V = "wan-i2v"
    # The same pipeline in the Wan2.1 I2V layout: a CLIP image encoder's hidden states join the text
    # in every block's cross-attention, besides the VAE's image latents.
    WAN21_I2V = "wan2.1-i2v"
    # diffusers WanPipeline with expand_timesteps (Wan2.2 TI2V-5B): text-to-video, and image-to-video
    # with a reference image in the first latent frame (as WanImageToVideoPipeline runs the folder).
    WAN_TI2V = "wan2.2-ti2v"
    # diffusers StableDiffusion3Pipeline (SD3.5): CLIP-L + CLIP-G + T5-XXL, SD3Transformer2DModel, AutoencoderKL.
    SD3 = "sd3"
    # diffusers ZImagePipeline: Qwen3 text model, ZImageTransformer2DModel (single stream), AutoencoderKL.
    Z_IMAGE = "z-image"
    # diffusers QwenImagePipeline: Qwen2.5-VL text encoder, QwenImageTransformer2DModel, AutoencoderKLQwenImage.
    QWEN_IMAGE = "qwen-image"
    # diffusers HunyuanVideo15Pipeline: Qwen2.5-VL text + ByT5 glyph encoders, HunyuanVideo15Transformer3DModel,
    # AutoencoderKLHunyuanVideo15 (16x spatial, 4x temporal). Videos.
    HUNYUAN_VIDEO15 = "hunyuan-video-1.5"
    # diffusers FluxKontextPipeline (FLUX.1 Kontext): FLUX.1's components; an image to edit conditions every step
    # in context (its latents join the noise's in the sequence), and without one it makes an image from text.
    FLUX_KONTEXT = "flux-kontext"
    # diffusers HunyuanVideo15ImageToVideoPipeline: the same, plus a SigLIP image encoder whose hidden states of
    # the reference image, and the VAE's latents of it as the first frame, condition every step.
    HUNYUAN_VIDEO15_I2V = "hunyuan-video-1.5-i2v"
    # diffusers QwenImageEditPipeline and QwenImageEditPlusPipeline (Qwen-Image-Edit, -2509, -2511): Qwen-Image's
    # components; the image to edit conditions the prompt (Qwen2.5-VL's vision tower) and every step in context.
    QWEN_IMAGE_EDIT = "qwen-image-edit"


class PipelineStage(str, enum.Enum):
    """One Serve deployment each; a str so it reads as its value in JSON, tags and dict keys."""

    ENCODE = "encode"  # the text encoder(s): once per request (twice with Wan's guidance)
    DENOISE = "denoise"  # the transformer: once or twice per step, the stage worth streaming
    DECODE = "decode"  # the VAE: once per request


class EditRule(str, enum.Enum):
    """Where an image edit enters a schedule of ``steps`` at ``strength``: each family's diffusers pipeline
    rounds its own way (with order-1 stepping: every served family's scheduler)."""

    # The image pipelines' get_timesteps (FluxImg2ImgPipeline, StableDiffusion3Img2ImgPipeline, ...):
    # at int(steps - steps * strength); any strength > 0 runs at least one step.
    IMG2IMG = "img2img"
    # WanVideoToVideoPipeline's (AnimateDiff's): at steps - int(steps * strength); a strength under
    # 1 / steps runs none.
    VIDEO2VIDEO = "video2video"
    # FLUX.1 Kontext's and Qwen-Image-Edit's: the image is not noised but conditions every step in context (its latents beside
    # the noise's in the transformer's sequence); the whole schedule runs and there is no strength.
    IN_CONTEXT = "in-context"

    def start(self, steps: int, strength: float) -> int:
        """The schedule's first step the edit runs: the image is noised to that step's sigma."""
        if self is EditRule.IN_CONTEXT:
            return 0
        if self is EditRule.IMG2IMG:
            return int(max(steps - min(steps * strength, steps), 0))
        return max(steps - min(int(steps * strength), steps), 0)


@dataclass(frozen=True)
class GenerationSpec:
    """One validated generation request, as every stage sees it."""

    request_id: str
    prompt: str
    negative_prompt: str | None
    height: int
    width: int
    num_frames: int  # 1 for images
    steps: int
    guidance_scale: float
    seed: int
    n: int  # outputs per prompt; the batch dimension of every tensor below
    # The reference image's file bytes (PNG/JPEG/WebP), checked by the ingress; image-to-video only.
    reference_image: bytes | None = None
    # The step cache's threshold for this request (deployments/models/step_cache.py): 0 is off;
    # None: the Denoiser's configured default.
    cache_threshold: float | None = None
    # The LoRA adapter this request applies in the Denoiser, by its configured name (never a path),
    # and its scale (the ingress resolves the adapter's configured scale); None: the base model.
    lora: str | None = None
    lora_scale: float = 1.0
    # Preview images to stream before the finished one (OpenAI's partial_images, 0-3; images only).
    partial_images: int = 0
    # An image edit (POST /v1/images/edits): ``reference_image`` is the image to edit, and this how far
    # the edit may go from it, in (0, 1] (diffusers' img2img ``strength``: the fraction of the schedule
    # run, from the image noised to that level). None: not an edit.
    strength: float | None = None
    # How the family's pipeline rounds where an edit enters its schedule (FamilyTraits.edit_rule).
    edit_rule: EditRule = EditRule.IMG2IMG
    # An inpainting edit's mask, as OpenAI takes it: a PNG of the image's size whose fully transparent
    # pixels mark where to edit (checked by the ingress); None: the edit may change the whole image.
    mask_image: bytes | None = None
    # A video edit (a remix of a finished job, POST /v1/videos/{id}/remix): its source video as H.264 mp4
    # bytes, whose first ``num_frames`` frames are edited at ``strength`` (``reference_image`` is None).
    reference_video: bytes | None = None
    # An in-context edit's further images, after ``reference_image`` (Qwen-Image-Edit-2509's "Picture 2",
    # "Picture 3": each conditions the prompt and every step), checked by the ingress; () for one image.
    context_images: tuple[bytes, ...] = ()
    # The text tokens the encoder gave this request's longest prompt row, where a family's prompts are not
    # padded to one length (Qwen-Image's): the Denoiser sets it from the encoded prompt, and its activation
    # model counts them beside the latents'. None before the encoder has run (FamilyAdapter.text_tokens).
    text_tokens: int | None = None

    @property
    def edit_images(self) -> tuple[bytes, ...]:
        """Every image an edit takes, in the order sent: ``reference_image``, then ``context_images``."""
        return () if self.reference_image is None else (self.reference_image, *self.context_images)

    @property
    def conditioned(self) -> bool:
        """Whether the decoder stage (it holds the VAE) encodes an image or a video for the Denoiser first:
        an image-to-video reference, or an edit's source."""
        return self.reference_image is not None or self.reference_video is not None

    @property
    def edit_start(self) -> int:
        """The schedule's first step this request runs: 0, or where an edit enters it."""
        return 0 if self.strength is None else self.edit_rule.start(self.steps, self.strength)

    @property
    def run_steps(self) -> int:
        """The denoising steps the request runs: ``steps``, or an edit's last ``strength`` of them."""
        return self.steps - self.edit_start

    @property
    def preview_steps(self) -> frozenset[int]:
        """The steps (1-based, as DenoiseProgress counts) after which the Denoiser sends a preview:
        ``partial_images`` spread evenly before the last step (fewer when there are too few steps)."""
        k, steps = self.partial_images, self.run_steps
        return frozenset(s for s in (round(i * steps / (k + 1)) for i in range(1, k + 1)) if 0 < s < steps)


@dataclass(frozen=True)
class EditSource:
    """An image edit's start, computed by the decoder stage (it holds the VAE) for the Denoiser."""

    # The image's latents as the family's img2img pipeline encodes them (sampled, shifted, scaled),
    # batch 1, on the CPU; the Denoiser repeats them to the request's n.
    latents: torch.Tensor
    # The request's generator (``generator_for(spec)``) after the VAE's sampling drew from it: the
    # Denoiser's noise continues from here, as the pipeline's single generator does.
    generator_state: torch.Tensor
    # An inpainting edit's mask at the latents' size, (1, 1, h, w): 1 where the edit repaints, 0 where
    # the image is kept (the inpaint pipeline's mask processor's, binarised), on the CPU; None: no mask.
    mask: torch.Tensor | None = None


@dataclass(frozen=True)
class EncodedPrompt:
    """The encoder stage's output: exactly what the pipeline's ``encode_prompt`` returned."""

    prompt_embeds: torch.Tensor
    # Wan with classifier-free guidance (guidance_scale > 1); None otherwise.
    negative_prompt_embeds: torch.Tensor | None = None
    # Flux's CLIP pooled embedding; None for Wan.
    pooled_prompt_embeds: torch.Tensor | None = None
    # The token length before :meth:`packed` dropped the trailing zero rows; None: as computed.
    padded_tokens: int | None = None
    # Image-to-video: the reference image's conditioning (mask + image latents), computed by the
    # decoder stage (it holds the VAE) and joined to the embeddings by the Denoiser; None otherwise.
    image_condition: torch.Tensor | None = None
    # Wan2.1 image-to-video: the CLIP image encoder's penultimate hidden states of the reference
    # image (n, 257, 1280 on the 14B), computed by the encoder stage (it holds the image encoder).
    image_embeds: torch.Tensor | None = None

    def to(self, device: torch.device) -> "EncodedPrompt":
        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device)

        return dataclasses.replace(
            self, prompt_embeds=move(self.prompt_embeds), negative_prompt_embeds=move(self.negative_prompt_embeds),
            pooled_prompt_embeds=move(self.pooled_prompt_embeds), image_condition=move(self.image_condition),
            image_embeds=move(self.image_embeds))

    def packed(self) -> "EncodedPrompt":
        """Without the trailing token rows that are zero in every sequence embedding, for the trip
        to the Denoiser. Wan pads its T5 output with zeros to 512 tokens: for a prompt of a few
        tokens that is 16 MiB of zeros per request on Wan 14B (2 x 512 x 4096 fp32), and on the tiny
        Wan 128 KiB, past Ray's 100 KiB inline limit, so the pair went through the object store.
        Lossless: a row with any non-zero bit (-0.0 included) is kept, and :meth:`unpacked` puts the
        zeros back. Flux's T5 output has no zero padding: it crosses whole."""
        sequences = [t for t in (self.prompt_embeds, self.negative_prompt_embeds) if t is not None]
        if self.padded_tokens is not None or len({t.shape[1:] for t in sequences}) != 1 or sequences[0].ndim != 3:
            return self
        tokens = sequences[0].shape[1]
        used = max(_used_tokens(t) for t in sequences)
        if used == tokens:
            return self

        def cut(t: torch.Tensor | None) -> torch.Tensor | None:
            # A clone: a pickled view would carry its whole storage, zeros and all.
            return None if t is None else t[:, :used].clone()

        return dataclasses.replace(self, prompt_embeds=cut(self.prompt_embeds),
                                   negative_prompt_embeds=cut(self.negative_prompt_embeds), padded_tokens=tokens)

    def unpacked(self) -> "EncodedPrompt":
        """The embeddings as the encoder computed them (bit for bit), zero rows restored."""
        if self.padded_tokens is None:
            return self

        def pad(t: torch.Tensor | None) -> torch.Tensor | None:
            if t is None:
                return None
            zeros = t.new_zeros(t.shape[0], self.padded_tokens - t.shape[1], *t.shape[2:])
            return torch.cat([t, zeros], dim=1)

        return dataclasses.replace(self, prompt_embeds=pad(self.prompt_embeds),
                                   negative_prompt_embeds=pad(self.negative_prompt_embeds), padded_tokens=None)


def _used_tokens(embeddings: torch.Tensor) -> int:
    """Tokens up to the last row (dim 1) holding any non-zero bit, over the batch."""
    data = (embeddings != 0) | torch.signbit(embeddings)
    rows = data.flatten(2).any(dim=2).any(dim=0).nonzero()
    return int(rows.max()) + 1 if len(rows) else 0


@dataclass(frozen=True)
class DenoiseProgress:
    """Denoising step ``step`` of ``total`` finished (1-based), streamed while the denoiser runs."""

    request_id: str
    step: int
    total: int
    # At a preview step (GenerationSpec.preview_steps): the latents the decoder turns into a preview
    # image, on the CPU (the step's estimate of the final latents); None at every other step.
    preview: torch.Tensor | None = None
    # On a CUDA replica, the event after ``preview``'s non-blocking copy to the host: the Denoiser waits
    # on it before the item leaves the replica (until then the tensor's bytes may not have landed).
    # Never crosses a process: pickling drops it.
    ready: object | None = dataclasses.field(default=None, compare=False, repr=False)

    def __reduce__(self):
        return (DenoiseProgress, (self.request_id, self.step, self.total, self.preview))


@dataclass(frozen=True)
class StageStats:
    """What one stage call cost, for metrics and the response."""

    stage: str
    replica: str
    seconds: float
    bytes_streamed: int  # host->device weight bytes copied during the call
    device_peak_bytes: int  # peak weight bytes materialized on the device during the call
    steps: int = 0  # denoising steps run (the Denoiser; 0 for the other stages)
    cache_skips: int = 0  # of them, steps whose remaining blocks the step cache skipped
    # Wall clock (time.time()) when the call started in its replica: with ``seconds`` it places the
    # call on the request's timeline (bench/serve.py's hops: HTTP and ingress in, stage to stage, out).
    started_at: float = 0.0


@dataclass(frozen=True)
class StageOutput:
    """A stage's tensor result with what it cost. ``value`` stays a tensor end to end."""

    value: torch.Tensor | EncodedPrompt
    stats: StageStats
    # The stats of the stages this output was computed from, in stage order: each stage passes its
    # input's along, so the ingress reports every stage without fetching an earlier stage's tensors
    # (the encoder's embeddings go replica to replica and never to the ingress).
    upstream: tuple[StageStats, ...] = ()

    @property
    def all_stats(self) -> tuple[StageStats, ...]:
        """Every stage's stats up to and including this one, in stage order."""
        return (*self.upstream, self.stats)

    def after(self, previous: "StageOutput") -> "StageOutput":
        """This output, carrying the stats of ``previous`` (its input) and of the stages before it."""
        return StageOutput(self.value, self.stats, previous.all_stats)


class RankLost(RuntimeError):
    """A rank of a tensor-parallel stage replica died or hung mid-call (deployments/replica/tensor_parallel/group.py):
    the call fails with 503 and Serve replaces the replica. Crosses Ray to the ingress."""


class NonFiniteOutput(RuntimeError):
    """The decoder made NaN or infinite values (a float16 overflow, a broken checkpoint): a server fault,
    said as a 500 naming it instead of a black image (a NaN casts to pixel 0). Crosses Ray to the ingress."""


class RequestRejected(ValueError):
    """A stage could not serve this request because of what the request asked (HTTP 4xx naming
    ``param``), as opposed to a fault of the server. Pickles itself: it crosses Ray to the ingress."""

    def __init__(self, param: str, message: str, status: int = 400):
        super().__init__(f"{param}: {message}")
        self.param, self.message, self.status = param, message, status

    def __reduce__(self):
        return (RequestRejected, (self.param, self.message, self.status))
