"""Qwen-Image (diffusers ``QwenImagePipeline``): Qwen2.5-VL text encoder, QwenImage MMDiT, AutoencoderKLQwenImage.

Images only. The knob mapping, as the pipeline means it: Qwen-Image's transformer is not
guidance-distilled, so the pipeline ignores its ``guidance_scale``; classifier-free guidance is
``true_cfg_scale`` with a negative prompt. The API's ``guidance_scale`` is therefore passed as
``true_cfg_scale``, and guidance runs exactly when the pipeline's would: above 1 *and* with a
negative prompt (``" "`` counts, as in Qwen-Image's own example). A request without one gets one
branch, as ``QwenImagePipeline(prompt, true_cfg_scale=4.0)`` does (it warns that guidance is off).
A guidance-distilled variant (``guidance_embeds``) gets it as its guidance embedding instead. Guidance rescales the combined prediction to the conditional one's
norm (the pipeline's rule). The staged split is exact (same seeded generator, same embeddings).
Run by the stage replicas; :meth:`QwenImageAdapter.facts` by the ingress (json only).
"""
from __future__ import annotations

import copy
import logging
import pathlib
from contextlib import nullcontext
from dataclasses import dataclass

import torch

from compat.diffusers import pack_latents, unpack_latents
from deployments.models import edits
from deployments.models.adapter import (
    CPU,
    DECODE,
    DENOISE,
    ENCODE,
    FamilyAdapter,
    FamilyTraits,
    generator_for,
    pipeline_images,
    read_json,
    step_callback,
)
from deployments.models.step_cache import BlockForm, BlockOutput
from deployments.models.steppers import BatchKey, StepRequest, TransformerStepper, cached, uncached
from deployments.wire.prompt_tensors import PromptTensors
from deployments.wire.spec import EditSource, Family, PipelineStage


class _MaskNotice(logging.Filter):
    """Drops the pipeline's per-call warning that a mask was not passed: the encoder passes one whenever
    the prompt has padding (``encode_prompt`` returns None exactly when every token counts)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "_mask` is not provided" not in record.getMessage()


logging.getLogger("diffusers.pipelines.qwenimage.pipeline_qwenimage").addFilter(_MaskNotice())

QWEN_GUIDANCE = 4.0  # QwenImagePipeline.__call__'s true_cfg_scale default
TEXT_TOKENS = 512  # the pipeline's max_sequence_length default
ACTIVATION_TEXT_TOKENS = 64  # a stand-in prompt's tokens for activation calibration (prompts are unpadded)


@dataclass(frozen=True)
class QwenImagePrompt(PromptTensors):
    """``QwenImagePipeline.encode_prompt``'s pairs: (n, tokens, 3584) and its mask (None: every token counts)."""

    prompt_embeds: torch.Tensor
    prompt_embeds_mask: torch.Tensor | None = None
    negative_prompt_embeds: torch.Tensor | None = None  # with guidance only
    negative_prompt_embeds_mask: torch.Tensor | None = None


def _distilled(pipe) -> bool:
    return bool(pipe.transformer.config.guidance_embeds)


def true_cfg(spec) -> bool:
    """QwenImagePipeline's ``do_true_cfg``: ``true_cfg_scale > 1`` and a negative prompt given."""
    return spec.guidance_scale > 1.0 and spec.negative_prompt is not None


def _pad(parts: list[torch.Tensor], masks: list[torch.Tensor | None]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Rows of different token counts in one tensor, zero-padded, with the mask the transformer needs
    (None when every row is full length and unmasked: then it is exactly the pipeline's input)."""
    longest = max(p.shape[1] for p in parts)
    full = [torch.ones(p.shape[:2], dtype=torch.long, device=p.device) if m is None else m for p, m in zip(parts, masks)]
    if all(p.shape[1] == longest for p in parts) and all(m is None for m in masks):
        return torch.cat(parts), None
    text = torch.cat([torch.nn.functional.pad(p, (0, 0, 0, longest - p.shape[1])) for p in parts])
    mask = torch.cat([torch.nn.functional.pad(m, (0, longest - m.shape[1])) for m in full])
    return text, mask


# QwenImageTransformerBlock returns (encoder, hidden) and takes the text mask per row.
QWEN_BLOCKS = BlockForm(BlockOutput.ENCODER_HIDDEN,
                        ("hidden_states", "encoder_hidden_states", "encoder_hidden_states_mask", "temb"))


class QwenImageStepper(TransformerStepper):
    """QwenImagePipeline's loop (diffusers 0.42), one step for a batch: both guidance branches of every
    request in one forward (prompts of other lengths zero-padded and masked)."""

    family = Family.QWEN_IMAGE.value

    def __init__(self, pipe, facts: FamilyTraits, device: torch.device):
        super().__init__(pipe, facts, device)
        # zero_cond_t (the edit variants) doubles temb's rows and adds a per-token modulate_index: a
        # sub-batch cannot be sliced by row, so those variants run every block.
        self.cacheable = not getattr(pipe.transformer.config, "zero_cond_t", False)
        # Guidance's branches as two forwards, as the pipeline runs them (a lone request's staged denoise:
        # bitwise the pipeline); the step batcher joins them in one, their texts padded to one length.
        self.branches_apart = False

    def start(self, encoded: QwenImagePrompt, spec, on_step=None) -> StepRequest:
        import numpy as np
        from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift, retrieve_timesteps

        pipe, device, dtype = self.pipe, self.device, self.dtype
        encoded = encoded.to(device)
        embeds = encoded.prompt_embeds.to(dtype)
        latents = self.noise(spec, embeds.dtype)
        scheduler = copy.deepcopy(pipe.scheduler)
        config = scheduler.config
        mu = calculate_shift(latents.shape[1], config.get("base_image_seq_len", 256), config.get("max_image_seq_len", 4096),
                             config.get("base_shift", 0.5), config.get("max_shift", 1.15))
        sigmas = np.linspace(1.0, 1 / spec.steps, spec.steps)
        timesteps, _ = retrieve_timesteps(scheduler, spec.steps, device, sigmas=sigmas, mu=mu)
        scheduler.set_begin_index(0)
        cond = {"text": embeds, "mask": encoded.prompt_embeds_mask}
        if _distilled(pipe):
            cond["guidance"] = torch.full([spec.n], spec.guidance_scale, device=device, dtype=torch.float32)
        uncond = None
        if not _distilled(pipe) and true_cfg(spec):
            uncond = {"text": encoded.negative_prompt_embeds.to(dtype), "mask": encoded.negative_prompt_embeds_mask}
        scale = pipe.vae_scale_factor * 2
        shared = {"img_shapes": [(1, spec.height // scale, spec.width // scale)]}  # an edit's image adds its own
        # Text lengths may differ (padded and masked in the forward): the key does not carry them.
        key = BatchKey(tuple(latents.shape[1:]), latents.dtype, 0, uncond is not None)
        return StepRequest(spec, key, scheduler, timesteps, latents, cond, uncond, on_step, shared)

    def begin_edit(self, request: StepRequest, source: EditSource) -> None:
        """QwenImageImg2ImgPipeline's start (QwenImageInpaintPipeline's too): the image's latents ([n, z, 1,
        h, w]) as [n, 1, z, h, w], noised to the edit's first step, packed; with a mask, the inpaint loop's
        blend after every step."""
        spec, pipe, dtype = request.spec, self.pipe, request.latents.dtype
        timestep = edits.enter_schedule(request)
        latents, image, noise = edits.noised(request, source, timestep, dtype, lambda t: t.transpose(1, 2))

        def pack(t: torch.Tensor) -> torch.Tensor:
            return pack_latents(pipe, t, spec.n, *t.shape[-3:])

        request.latents = pack(latents)
        if source.mask is not None:  # QwenImageInpaintPipeline.prepare_mask_latents: one mask row per channel
            mask = source.mask.to(latents.device, dtype).repeat(spec.n, latents.shape[2], 1, 1)
            edits.inpaint(request, pack(image), pack(noise), pack(mask))

    def noise(self, spec, dtype: torch.dtype) -> torch.Tensor:
        """The request's first latents, packed: the pipeline's ``prepare_latents`` with its generator."""
        pipe = self.pipe
        return pipe.prepare_latents(spec.n, pipe.transformer.config.in_channels // 4, spec.height, spec.width,
                                    dtype, self.device, generator_for(spec), None)

    def model_input(self, batch: list[StepRequest], latents: torch.Tensor) -> torch.Tensor:
        """The transformer's sequence for ``latents`` (the batch's rows): the latents' tokens alone here
        (an in-context edit appends its image's: qwen_image_edit)."""
        return latents

    def _predict(self, latents: torch.Tensor, timestep: torch.Tensor, branches: list[dict],
                 guidance: torch.Tensor | None, shared: dict) -> torch.Tensor:
        """One transformer forward over ``latents``' rows, each with its branch's text (zero-padded, masked)."""
        text, mask = _pad([b["text"] for b in branches], [b["mask"] for b in branches])
        return self.pipe.transformer(hidden_states=latents, timestep=timestep / 1000, guidance=guidance,
                                     encoder_hidden_states_mask=mask, encoder_hidden_states=text,
                                     img_shapes=[shared["img_shapes"]] * latents.shape[0], return_dict=False)[0]

    def forward(self, batch: list[StepRequest]) -> list[torch.Tensor]:
        latents = torch.cat([r.latents for r in batch])
        tokens = latents.shape[1]
        timestep = torch.cat([r.timesteps[r.step].expand(r.latents.shape[0]) for r in batch]).to(latents.dtype)
        latents = self.model_input(batch, latents)
        branches = [r.cond for r in batch]
        guided = batch[0].key.guided
        if guided:
            branches += [r.uncond for r in batch]
            latents, timestep = torch.cat([latents, latents]), torch.cat([timestep, timestep])
        guidance = torch.cat([r.cond["guidance"] for r in batch]) if "guidance" in batch[0].cond else None
        if not self.cacheable:
            uncached(batch, self.family)
        apart = guided and self.branches_apart
        step_cache = cached(self.pipe.transformer, batch, guided, QWEN_BLOCKS) if self.cacheable and not apart \
            else nullcontext()
        with step_cache:
            if apart:  # the pipeline's two forwards, each branch's text unpadded
                halves = zip(latents.chunk(2), timestep.chunk(2), (branches[:len(batch)], branches[len(batch):]))
                noise = torch.cat([self._predict(*half, guidance, batch[0].shared) for half in halves])
            else:
                noise = self._predict(latents, timestep, branches, guidance, batch[0].shared)
        noise = noise[:, :tokens]  # the latents' own tokens
        out, start, rows = [], 0, sum(r.latents.shape[0] for r in batch)
        for r in batch:
            n = r.latents.shape[0]
            cond = noise[start:start + n]
            if guided:  # the pipeline's true CFG, rescaled to the conditional prediction's norm
                neg = noise[rows + start:rows + start + n]
                comb = neg + r.spec.guidance_scale * (cond - neg)
                cond = comb * (torch.norm(cond, dim=-1, keepdim=True) / torch.norm(comb, dim=-1, keepdim=True))
            out.append(cond)
            start += n
        return out


def qwen_latents(vae, sampled: torch.Tensor) -> torch.Tensor:
    """QwenImageImg2ImgPipeline._encode_vae_image's normalisation: per channel, by the VAE's mean and std."""
    shape = (1, vae.config.z_dim, 1, 1, 1)
    mean = torch.tensor(vae.config.latents_mean).view(shape).to(sampled.device, sampled.dtype)
    inv_std = 1.0 / torch.tensor(vae.config.latents_std).view(shape).to(sampled.device, sampled.dtype)
    return (sampled - mean) * inv_std


class QwenImageAdapter(edits.ImageEdits, FamilyAdapter):
    family = Family.QWEN_IMAGE
    pipeline_classes = ("QwenImagePipeline",)
    edit_pipeline = "QwenImageImg2ImgPipeline"
    inpaint_pipeline = "QwenImageInpaintPipeline"
    to_latents = staticmethod(qwen_latents)
    frame_axis = True  # its VAE encodes videos: the image is a one-frame one
    stage_modules = {ENCODE: ("text_encoder",), DENOISE: ("transformer",), DECODE: ("vae",)}
    stage_helpers = {ENCODE: ("tokenizer",), DENOISE: ("scheduler",), DECODE: ()}
    serves = ("image",)

    def facts(self, folder, index) -> FamilyTraits:
        vae = read_json(folder / "vae" / "config.json")
        # QwenImagePipeline: 2 ** len(temperal_downsample) spatial, x2 for the packed 2x2 patches.
        multiple = 2 ** len(vae.get("temperal_downsample", [False, True, True])) * 2
        return FamilyTraits(self.family, str(folder), multiple, 1, False, True, QWEN_GUIDANCE,
                           pipeline_class=index["_class_name"], modalities=self.modalities(index))

    def restore_scale_factors(self, pipe, facts) -> None:
        vae = read_json(pathlib.Path(facts.folder) / "vae" / "config.json")
        pipe.vae_scale_factor = 2 ** len(vae.get("temperal_downsample", [False, True, True]))

    @torch.no_grad()
    def encode(self, pipe, facts, spec, device) -> QwenImagePrompt:
        positive, mask = pipe.encode_prompt(prompt=spec.prompt, device=device, num_images_per_prompt=spec.n,
                                            max_sequence_length=TEXT_TOKENS)
        negative = negative_mask = None
        if true_cfg(spec):  # a distilled transformer's pipe never reads them; encoding them is cheap
            negative, negative_mask = pipe.encode_prompt(prompt=spec.negative_prompt, device=device,
                                                         num_images_per_prompt=spec.n, max_sequence_length=TEXT_TOKENS)
        return QwenImagePrompt(positive, mask, negative, negative_mask).to(CPU)

    def _knobs(self, pipe, spec, as_sent: bool = False) -> dict:
        """The pipeline's guidance arguments for ``spec``. ``as_sent``: exactly what a user passes (the
        request's scale as ``true_cfg_scale`` even without a negative prompt, which the pipeline then
        ignores with a warning); else 1.0 where guidance is off, the same result without the warning
        on every request."""
        if _distilled(pipe):
            return dict(guidance_scale=spec.guidance_scale, true_cfg_scale=1.0)
        return dict(guidance_scale=None, true_cfg_scale=spec.guidance_scale if as_sent or true_cfg(spec) else 1.0)

    def denoise(self, pipe, facts, encoded, spec, device, on_step=None) -> torch.Tensor:
        encoded = encoded.to(device)
        out = pipe(prompt_embeds=encoded.prompt_embeds, prompt_embeds_mask=encoded.prompt_embeds_mask,
                   negative_prompt_embeds=encoded.negative_prompt_embeds,
                   negative_prompt_embeds_mask=encoded.negative_prompt_embeds_mask,
                   height=spec.height, width=spec.width, num_inference_steps=spec.steps,
                   generator=generator_for(spec), output_type="latent", num_images_per_prompt=1,
                   callback_on_step_end=step_callback(spec, on_step), callback_on_step_end_tensor_inputs=[],
                   max_sequence_length=TEXT_TOKENS, **self._knobs(pipe, spec))
        return out.images.to(CPU)

    @torch.no_grad()
    def decode(self, pipe, facts, latents, spec, device) -> torch.Tensor:
        vae = pipe.vae  # the tail of QwenImagePipeline.__call__
        latents = unpack_latents(pipe, latents, spec.height, spec.width).to(device, vae.dtype)
        shape = (1, vae.config.z_dim, 1, 1, 1)
        mean = torch.tensor(vae.config.latents_mean).view(shape).to(latents.device, latents.dtype)
        inv_std = 1.0 / torch.tensor(vae.config.latents_std).view(shape).to(latents.device, latents.dtype)
        image = vae.decode(latents / inv_std + mean, return_dict=False)[0][:, :, 0]
        return torch.from_numpy(pipe.image_processor.postprocess(image, output_type="np")).unsqueeze(1)

    def stepper(self, pipe, facts, device) -> QwenImageStepper:
        return QwenImageStepper(pipe, facts, device)

    def reference_frames(self, pipe, facts, spec) -> torch.Tensor:
        if spec.strength is not None:
            return super().reference_frames(pipe, facts, spec)
        return pipeline_images(pipe, spec, **self.edit_knobs(pipe, spec))

    def edit_knobs(self, pipe, spec) -> dict:
        # What a user passes: the request's negative prompt as is (a distilled variant's pipe ignores it).
        negative = None if _distilled(pipe) else spec.negative_prompt
        return dict(negative_prompt=negative, **self._knobs(pipe, spec, as_sent=True))

    def uses_per_request(self, facts, stage, steps, guidance_scale, batched=False) -> dict[str, int]:
        # The default request has no negative prompt, so no true CFG: one encoder pass and one
        # transformer forward per step. A request with one runs two of each in the pipeline's loop
        # (step batching joins both branches in one forward), at most twice what is planned here.
        return self.uses_by_stage(facts, stage, encode=1, denoise=steps)

    def text_tokens(self, facts, spec) -> int:
        # Prompts are not padded: priced at the stand-in's 64 tokens, a guided 512-token prompt at 32x48 peaked
        # at 7.5x the prediction on the tiny model (test_activation_features.py), an 867-token edit at 1.08x.
        return ACTIVATION_TEXT_TOKENS if spec.text_tokens is None else spec.text_tokens

    def encoded_text_tokens(self, encoded: QwenImagePrompt) -> int:
        return max(e.shape[1] for e in (encoded.prompt_embeds, encoded.negative_prompt_embeds) if e is not None)

    def activation_input(self, pipe, facts, stage, spec):
        stage = PipelineStage(stage)
        if stage is ENCODE:
            return None
        if stage is DENOISE:
            text = torch.zeros(spec.n, self.text_tokens(facts, spec), pipe.transformer.config.joint_attention_dim)
            if true_cfg(spec) and not _distilled(pipe):
                return QwenImagePrompt(text, None, text.clone(), None)
            return QwenImagePrompt(text)
        scale = pipe.vae_scale_factor * 2  # 2x2 latent patches packed into one token of 4 x z_dim
        return torch.zeros(spec.n, (spec.height // scale) * (spec.width // scale), pipe.vae.config.z_dim * 4)


ADAPTERS = (QwenImageAdapter(),)
