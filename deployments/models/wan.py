"""The Wan text-to-video family (diffusers ``WanPipeline``): Wan2.1, Wan2.2 T2V-A14B, Wan2.2 TI2V-5B.

One adapter for the three, because one pipeline class runs them; what differs is read from the
folder: Wan2.2 A14B has two experts (``transformer`` above ``boundary_ratio`` x 1000, then
``transformer_2``), TI2V-5B expands the timestep to one per latent token and has a 48-channel
VAE with 16x spatial compression (so sizes are multiples of 32, not 16). An image is a video of
one frame.

The staged split is exact: the encoder runs the pipeline's own ``encode_prompt``, the denoiser
runs the same pipeline with ``prompt_embeds=...`` and ``output_type="latent"`` (same seeded
generator, so the same noise), and the decoder decodes the latents as the pipeline's tail does.
Run by the stage replicas; :meth:`WanAdapter.facts` by the ingress (json only).
"""
from __future__ import annotations

import copy
import math
import pathlib
from typing import Mapping

import torch

from deployments.models import edits
from deployments.models.adapter import (
    CPU,
    DECODE,
    DENOISE,
    ENCODE,
    FamilyAdapter,
    FamilyTraits,
    generator_for,
    read_json,
    step_callback,
)
from deployments.models.steppers import BatchKey, StepRequest, cached, guided_noise, rows_of, split_noise
from deployments.wire.spec import EditRule, EditSource, EncodedPrompt, Family, GenerationSpec, PipelineStage
from offload_core.planner.inputs import expert_steps as planner_expert_steps

# WanPipeline.__call__'s default guidance; Wan2.2 A14B uses the same scale for both experts
# (guidance_scale_2 defaults to guidance_scale).
WAN_GUIDANCE = 5.0
TEXT_TOKENS = 512  # encode pads every prompt to max_sequence_length=512


def experts_of(index: Mapping) -> tuple[str, ...]:
    """The denoiser's transformers, in the order they run: ``transformer_2`` only when the folder has one."""
    second = index.get("transformer_2")
    return ("transformer", "transformer_2") if isinstance(second, list) and second[0] is not None else ("transformer",)


def wan_facts(adapter: FamilyAdapter, folder: pathlib.Path, index: Mapping, **extra) -> FamilyTraits:
    vae = read_json(folder / "vae" / "config.json")
    patch = read_json(folder / "transformer" / "config.json").get("patch_size", [1, 2, 2])
    spatial = int(vae.get("scale_factor_spatial", 8))
    multiple = math.lcm(16, spatial * int(patch[1]), spatial * int(patch[2]))
    return FamilyTraits(adapter.family, str(folder), multiple, int(vae.get("scale_factor_temporal", 4)), True, True,
                       WAN_GUIDANCE, pipeline_class=index["_class_name"], modalities=adapter.modalities(index),
                       experts=experts_of(index), **extra)


def expert_for(pipe, t: torch.Tensor) -> str:
    """The transformer that runs timestep ``t`` (WanPipeline's switch): ``transformer`` at or above
    ``boundary_ratio`` x num_train_timesteps, ``transformer_2`` below."""
    ratio = pipe.config.boundary_ratio
    if ratio is None or t >= ratio * pipe.scheduler.config.num_train_timesteps:
        return "transformer"
    return "transformer_2"


def wan_decode(pipe, latents: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The tail of WanPipeline.__call__ (and of WanImageToVideoPipeline's)."""
    vae = pipe.vae
    latents = latents.to(device, dtype=vae.dtype)
    mean = torch.tensor(vae.config.latents_mean).view(1, vae.config.z_dim, 1, 1, 1).to(latents.device, latents.dtype)
    inv_std = 1.0 / torch.tensor(vae.config.latents_std).view(1, vae.config.z_dim, 1, 1, 1).to(
        latents.device, latents.dtype)
    video = vae.decode(latents / inv_std + mean, return_dict=False)[0]
    return torch.from_numpy(pipe.video_processor.postprocess_video(video, output_type="np"))


def wan_frames(pipe, spec: GenerationSpec) -> int:
    """num_frames as WanPipeline rounds it: 1 + k x the VAE's temporal factor."""
    factor = pipe.vae_scale_factor_temporal
    frames = spec.num_frames if spec.num_frames % factor == 1 else spec.num_frames // factor * factor + 1
    return max(frames, 1)


class WanStepper:
    """WanPipeline's loop (diffusers 0.42), one step for a batch. Guidance > 1 runs both branches in
    one forward; requests whose current timestep falls on different experts (Wan2.2 A14B) run as
    separate forwards of the same step, each on its own expert's weights."""

    def __init__(self, pipe, facts: FamilyTraits, device: torch.device):
        self.pipe, self.device, self.experts = pipe, device, facts.experts
        # Read once: ModelMixin.dtype walks the parameters, a quarter of the tiny Wan's step time
        # when read per forward (py-spy, bench/serve.py --quick).
        self.dtype = getattr(pipe, facts.experts[0]).dtype
        self.expand = bool(pipe.config.expand_timesteps)
        self.forwards_by_expert = dict.fromkeys(facts.experts, 0)

    def start(self, encoded, spec, on_step=None) -> StepRequest:
        pipe, device, dtype = self.pipe, self.device, self.dtype
        encoded = encoded.to(device)
        scheduler = copy.deepcopy(pipe.scheduler)
        scheduler.set_timesteps(spec.steps, device=device)
        scheduler.set_begin_index(0)
        latents = self.initial_latents(encoded, spec)
        guided = spec.guidance_scale > 1.0
        cond = {"encoder_hidden_states": encoded.prompt_embeds.to(dtype)}
        uncond = {"encoder_hidden_states": encoded.negative_prompt_embeds.to(dtype)} if guided else None
        key = BatchKey(tuple(latents.shape[1:]), dtype, cond["encoder_hidden_states"].shape[1], guided)
        request = StepRequest(spec, key, scheduler, scheduler.timesteps, latents, cond, uncond, on_step)
        self.attach(request, encoded)
        return request

    def begin_edit(self, request: StepRequest, source: EditSource) -> None:
        """WanVideoToVideoPipeline's start (a one-frame video): the image's latents noised by the
        scheduler's add_noise to the edit's first step, float32."""
        timestep = edits.enter_schedule(request)
        request.latents, _, _ = edits.noised(request, source, timestep, torch.float32, add_noise=True)

    def initial_latents(self, encoded: EncodedPrompt, spec: GenerationSpec) -> torch.Tensor:
        pipe = self.pipe
        channels = getattr(pipe, self.experts[0]).config.in_channels
        return pipe.prepare_latents(spec.n, channels, spec.height, spec.width, wan_frames(pipe, spec), torch.float32,
                                    self.device, generator_for(spec), None)

    def attach(self, request: StepRequest, encoded: EncodedPrompt) -> None:
        """Per-request inputs beyond the text (image-to-video's condition)."""

    def model_input(self, request: StepRequest) -> torch.Tensor:
        return request.latents.to(self.dtype)

    def timestep(self, request: StepRequest) -> torch.Tensor:
        t, rows = request.timesteps[request.step], request.latents.shape[0]
        if not self.expand:
            return t.expand(rows)
        # TI2V: one timestep per latent token (frames x H/2 x W/2), as WanPipeline's mask[0][0][:, ::2, ::2].
        tokens = request.latents[0, 0][:, ::2, ::2].numel()
        return torch.full((tokens,), 1.0, dtype=torch.float32, device=t.device).mul(t).unsqueeze(0).expand(rows, -1)

    def forward(self, batch: list[StepRequest]) -> list[torch.Tensor]:
        groups: dict[str, list[int]] = {}
        for i, r in enumerate(batch):
            groups.setdefault(expert_for(self.pipe, r.timesteps[r.step]), []).append(i)
        out: list[torch.Tensor | None] = [None] * len(batch)
        for expert, members in groups.items():  # one forward per expert in use at this step
            for i, noise in zip(members, self.expert_forward(expert, [batch[i] for i in members])):
                out[i] = noise
        return out

    def image_inputs(self, batch: list[StepRequest], guided: bool) -> dict[str, torch.Tensor]:
        """Transformer inputs beyond the text, for the batch's rows (Wan2.1 image-to-video's image embeddings)."""
        return {}

    def expert_forward(self, expert: str, batch: list[StepRequest]) -> list[torch.Tensor]:
        self.forwards_by_expert[expert] += 1
        latents = torch.cat([self.model_input(r) for r in batch])
        timestep = torch.cat([self.timestep(r) for r in batch])
        text = rows_of(batch, "encoder_hidden_states", "cond")
        guided = batch[0].key.guided
        if guided:  # both branches in one forward: the weights stream once for both
            latents, timestep = torch.cat([latents, latents]), torch.cat([timestep, timestep])
            text = torch.cat([text, rows_of(batch, "encoder_hidden_states", "uncond")])
        transformer = getattr(self.pipe, expert)
        with cached(transformer, batch, guided):
            noise = transformer(hidden_states=latents, timestep=timestep, encoder_hidden_states=text,
                                return_dict=False, **self.image_inputs(batch, guided))[0]
        if guided:
            cond, uncond = noise.chunk(2)
            return guided_noise(batch, cond, uncond)
        return split_noise(batch, noise)


def wan_latents(vae, sampled: torch.Tensor) -> torch.Tensor:
    """WanVideoToVideoPipeline.prepare_latents' normalisation: float32, per channel by the VAE's mean and std."""
    sampled = sampled.to(torch.float32)
    shape = (1, vae.config.z_dim, 1, 1, 1)
    mean = torch.tensor(vae.config.latents_mean).view(shape).to(sampled.device, torch.float32)
    inv_std = 1.0 / torch.tensor(vae.config.latents_std).view(shape).to(sampled.device, torch.float32)
    return (sampled - mean) * inv_std


class WanAdapter(edits.ImageEdits, FamilyAdapter):
    family = Family.WAN
    pipeline_classes = ("WanPipeline",)
    stage_modules = {ENCODE: ("text_encoder",), DENOISE: ("transformer",), DECODE: ("vae",)}
    stage_helpers = {ENCODE: ("tokenizer",), DENOISE: ("scheduler",), DECODE: ()}
    serves = ("image", "video")  # and image-edit, video-edit where one transformer runs (edits)
    # An image edit is WanVideoToVideoPipeline's edit of a one-frame video: it runs one transformer (no
    # Wan2.2 A14B expert switch), reads the VAE's mode (no draw) and rounds its start its own way.
    edit_pipeline = "WanVideoToVideoPipeline"
    to_latents = staticmethod(wan_latents)
    sample_mode = "argmax"
    edits_videos = True  # the same pipeline on a finished video's frames: POST /v1/videos/{id}/remix

    def recognises(self, index) -> bool:
        # A WanPipeline folder with expanded timesteps (TI2V-5B) is deployments.models.wan_ti2v's.
        return super().recognises(index) and not index.get("expand_timesteps")

    def facts(self, folder, index) -> FamilyTraits:
        return wan_facts(self, folder, index, edit_rule=EditRule.VIDEO2VIDEO)

    def edits(self, index) -> bool:
        # WanVideoToVideoPipeline runs one transformer: no Wan2.2 A14B expert switch.
        return super().edits(index) and experts_of(index) == ("transformer",)

    def edit_image(self, pipe, spec) -> torch.Tensor:
        # WanVideoToVideoPipeline's preprocessing: the video's frames (an image: one), (1, c, frames, h, w).
        video = pipe.video_processor.preprocess_video(edits.source_frames(spec), height=spec.height, width=spec.width)
        return video.to(dtype=torch.float32)

    def modules(self, facts, stage):
        return facts.experts if PipelineStage(stage) is DENOISE else super().modules(facts, stage)

    def phases(self, facts, stage):
        # One expert runs per step: each is its own phase, so its working set alone is on the device.
        if PipelineStage(stage) is DENOISE and len(facts.experts) > 1:
            return tuple((expert,) for expert in facts.experts)
        return super().phases(facts, stage)

    def restore_scale_factors(self, pipe, facts) -> None:
        vae = read_json(pathlib.Path(facts.folder) / "vae" / "config.json")
        pipe.vae_scale_factor_spatial = int(vae.get("scale_factor_spatial", 8))
        pipe.vae_scale_factor_temporal = int(vae.get("scale_factor_temporal", 4))

    @torch.no_grad()
    def encode(self, pipe, facts, spec, device) -> EncodedPrompt:
        positive, negative = pipe.encode_prompt(
            prompt=spec.prompt, negative_prompt=spec.negative_prompt,
            do_classifier_free_guidance=spec.guidance_scale > 1.0, num_videos_per_prompt=spec.n,
            max_sequence_length=TEXT_TOKENS, device=device)
        return EncodedPrompt(positive, negative_prompt_embeds=negative).to(CPU)

    def denoise(self, pipe, facts, encoded, spec, device, on_step=None) -> torch.Tensor:
        encoded = encoded.to(device)  # the pipelines cast embeddings' dtype, never their device
        # The embeddings already hold n rows, so one video per embedding row.
        out = pipe(prompt_embeds=encoded.prompt_embeds, negative_prompt_embeds=encoded.negative_prompt_embeds,
                   height=spec.height, width=spec.width, num_frames=spec.num_frames, num_inference_steps=spec.steps,
                   guidance_scale=spec.guidance_scale, generator=generator_for(spec), output_type="latent",
                   num_videos_per_prompt=1, callback_on_step_end=step_callback(spec, on_step),
                   callback_on_step_end_tensor_inputs=[])
        return out.frames.to(CPU)

    @torch.no_grad()
    def decode(self, pipe, facts, latents, spec, device) -> torch.Tensor:
        return wan_decode(pipe, latents, device)

    def stepper(self, pipe, facts, device) -> WanStepper:
        return WanStepper(pipe, facts, device)

    def reference_frames(self, pipe, facts, spec) -> torch.Tensor:
        if spec.strength is not None:  # WanVideoToVideoPipeline makes one video per embedding row
            with torch.no_grad():  # as the encoder stage and the pipeline's own call encode (grad mode picks other kernels)
                positive, negative = pipe.encode_prompt(
                    prompt=spec.prompt, negative_prompt=spec.negative_prompt,
                    do_classifier_free_guidance=spec.guidance_scale > 1.0, num_videos_per_prompt=spec.n,
                    max_sequence_length=TEXT_TOKENS)
            return torch.from_numpy(self.edit_pipeline_of(pipe)(
                video=edits.source_frames(spec), prompt_embeds=positive, negative_prompt_embeds=negative,
                height=spec.height, width=spec.width, num_inference_steps=spec.steps, strength=spec.strength,
                guidance_scale=spec.guidance_scale, generator=generator_for(spec), output_type="np").frames)
        return torch.from_numpy(pipe(
            prompt=spec.prompt, negative_prompt=spec.negative_prompt, height=spec.height, width=spec.width,
            num_frames=spec.num_frames, num_inference_steps=spec.steps, guidance_scale=spec.guidance_scale,
            num_videos_per_prompt=spec.n, generator=generator_for(spec), output_type="np").frames)

    def uses_per_request(self, facts, stage, steps, guidance_scale, batched=False) -> dict[str, int]:
        # Classifier-free guidance when guidance > 1: two encoder and two transformer passes in the
        # pipeline's own loop (one batched forward in the Denoiser's).
        cfg = 2 if guidance_scale > 1.0 else 1
        stage = PipelineStage(stage)
        if stage is ENCODE:
            return {"text_encoder": cfg}
        if stage is DECODE:
            return {"vae": 1}
        per_step = 1 if batched else cfg
        return {name: n * per_step for name, n in expert_steps(facts, steps).items()}

    def warmup_steps(self, facts) -> int:
        # The fewest steps that reach the low-noise expert (2 for the tiny A14B and I2V, at shift 3.0).
        steps = 1
        while min(expert_steps(facts, steps).values()) == 0:
            steps += 1
        return steps

    def activation_input(self, pipe, facts, stage, spec):
        stage = PipelineStage(stage)
        if stage is ENCODE:
            return None
        if stage is DENOISE:
            embeds = torch.zeros(spec.n, TEXT_TOKENS, getattr(pipe, facts.experts[0]).config.text_dim)
            return EncodedPrompt(embeds, embeds.clone() if spec.guidance_scale > 1.0 else None)
        scale = pipe.vae_scale_factor_spatial
        frames = 1 + (spec.num_frames - 1) // facts.temporal_factor
        return torch.zeros(spec.n, pipe.vae.config.z_dim, frames, spec.height // scale, spec.width // scale)


def expert_steps(facts: FamilyTraits, steps: int) -> dict[str, int]:
    """Steps each expert runs for ``steps`` denoising steps: the folder's scheduler's timesteps split
    at the boundary (Wan2.2 A14B at 40 steps: flow_shift 3.0 as the diffusers folder writes it, 13
    high-noise and 27 low-noise; 12.0 as Wan2.2 samples, 26 and 14)."""
    if len(facts.experts) == 1:
        return {facts.experts[0]: steps}
    folder = pathlib.Path(facts.folder)
    raw = read_json(folder / "scheduler" / "scheduler_config.json")
    scheduler = {"class": raw.get("_class_name", ""), "config": {k: v for k, v in raw.items() if k[0] != "_"}}
    high, low = planner_expert_steps(steps, scheduler, read_json(folder / "model_index.json")["boundary_ratio"],
                                     float(scheduler["config"].get("flow_shift", 1.0)))
    return {facts.experts[0]: high, facts.experts[1]: low}


ADAPTERS = (WanAdapter(),)
