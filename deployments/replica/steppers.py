"""One denoising step, family by family, for a batch of requests that each keep their own state.

The pipelines' ``__call__`` runs one request from its first step to its last. Step-level batching
(``deployments.replica.batching``) needs the loop opened up: each request keeps its own scheduler copy
(multistep schedulers keep history), timesteps, guidance scale, seeded latents and embeddings, and
one transformer forward per step boundary serves every request in the batch, classifier-free
guidance's two branches included. What goes into that forward is exactly what the pipeline's own
loop feeds the transformer for each request (same dtypes, same per-row timestep), so a batch of
one is the pipeline's computation, and a larger batch differs only by the batched kernels.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Callable, Protocol

import torch

from deployments.models.families import FamilyFacts, generator_for
from deployments.replica.cancel import CancelFlag
from deployments.wire.spec import DenoiseProgress, EncodedPrompt, Family, GenerationSpec


@dataclass(frozen=True)
class BatchKey:
    """Requests with equal keys can share a forward: same row shape, dtype, text length, guidance."""

    row_shape: tuple[int, ...]  # one latent row, without the batch dimension
    dtype: torch.dtype
    text_tokens: int
    guided: bool  # two branches (classifier-free guidance) per row, or one


@dataclass(eq=False)
class StepRequest:
    """One request's own denoising state between step boundaries."""

    spec: GenerationSpec
    key: BatchKey
    scheduler: object  # this request's own copy of the pipeline's scheduler
    timesteps: torch.Tensor
    latents: torch.Tensor  # (n, ...) float32 as the pipeline keeps them
    cond: dict[str, torch.Tensor]  # per-row transformer inputs of the conditional branch
    uncond: dict[str, torch.Tensor] | None  # the same for the unconditional branch, when guided
    on_step: Callable[[DenoiseProgress], None] | None = None
    shared: dict[str, torch.Tensor] = field(default_factory=dict)  # inputs equal for equal keys
    step: int = 0  # steps done
    cancel: CancelFlag = None  # set in __post_init__: one flag per request

    def __post_init__(self) -> None:
        if self.cancel is None:
            self.cancel = CancelFlag(self.spec.request_id)
    bytes_streamed: float = 0.0  # this request's share of the weights streamed for its forwards
    waited_s: float = 0.0  # queued before it joined a batch

    @property
    def rows(self) -> int:
        """Transformer rows this request adds to a forward (both branches when guided)."""
        return self.latents.shape[0] * (2 if self.uncond is not None else 1)

    @property
    def done(self) -> bool:
        return self.step >= len(self.timesteps)

    def advance(self, noise_pred: torch.Tensor) -> None:
        t = self.timesteps[self.step]
        self.latents = self.scheduler.step(noise_pred, t, self.latents, return_dict=False)[0]
        self.step += 1
        if self.on_step is not None:
            self.on_step(DenoiseProgress(self.spec.request_id, self.step, len(self.timesteps)))


class Stepper(Protocol):
    """A family's half of step batching: start a request, run one forward for a batch of them."""

    def start(self, encoded: EncodedPrompt, spec: GenerationSpec,
              on_step: Callable[[DenoiseProgress], None] | None = None) -> StepRequest: ...

    def forward(self, batch: list[StepRequest]) -> list[torch.Tensor]: ...


def _rows(batch: list[StepRequest], name: str, branch: str) -> torch.Tensor:
    return torch.cat([getattr(r, branch)[name] for r in batch])


def _guided(batch: list[StepRequest], cond: torch.Tensor, uncond: torch.Tensor) -> list[torch.Tensor]:
    """Each request's guided noise from its rows of the batched output, with its own scale."""
    out, start = [], 0
    for r in batch:
        n = r.latents.shape[0]
        c, u = cond[start:start + n], uncond[start:start + n]
        out.append(u + r.spec.guidance_scale * (c - u))
        start += n
    return out


def _split(batch: list[StepRequest], noise: torch.Tensor) -> list[torch.Tensor]:
    return list(noise.split([r.latents.shape[0] for r in batch]))


class WanStepper:
    """WanPipeline's loop (diffusers 0.42), one step for a batch; guidance > 1 runs both branches."""

    def __init__(self, pipe, facts: FamilyFacts, device: torch.device):
        assert facts.family is Family.WAN, facts.family
        assert not pipe.config.expand_timesteps and pipe.config.boundary_ratio is None, \
            "Wan2.2's expanded timesteps and two-expert switch are not batched yet"
        self.pipe, self.device = pipe, device
        # Read once: ModelMixin.dtype walks the parameters, a quarter of the tiny Wan's step time
        # when read per forward (py-spy, bench/serve.py --quick).
        self.dtype = pipe.transformer.dtype

    def start(self, encoded, spec, on_step=None) -> StepRequest:
        pipe, device, dtype = self.pipe, self.device, self.dtype
        encoded = encoded.to(device)
        scheduler = copy.deepcopy(pipe.scheduler)
        scheduler.set_timesteps(spec.steps, device=device)
        scheduler.set_begin_index(0)
        factor = pipe.vae_scale_factor_temporal  # as WanPipeline rounds num_frames to 1 + k * factor
        frames = max(spec.num_frames if spec.num_frames % factor == 1 else spec.num_frames // factor * factor + 1, 1)
        latents = pipe.prepare_latents(spec.n, pipe.transformer.config.in_channels, spec.height, spec.width,
                                       frames, torch.float32, device, generator_for(spec), None)
        guided = spec.guidance_scale > 1.0
        cond = {"encoder_hidden_states": encoded.prompt_embeds.to(dtype)}
        uncond = {"encoder_hidden_states": encoded.negative_prompt_embeds.to(dtype)} if guided else None
        key = BatchKey(tuple(latents.shape[1:]), dtype, cond["encoder_hidden_states"].shape[1], guided)
        return StepRequest(spec, key, scheduler, scheduler.timesteps, latents, cond, uncond, on_step)

    def forward(self, batch: list[StepRequest]) -> list[torch.Tensor]:
        dtype = self.dtype
        latents = torch.cat([r.latents for r in batch]).to(dtype)
        timestep = torch.cat([r.timesteps[r.step].expand(r.latents.shape[0]) for r in batch])
        text = _rows(batch, "encoder_hidden_states", "cond")
        guided = batch[0].key.guided
        if guided:  # both branches in one forward: the weights stream once for both
            latents, timestep = torch.cat([latents, latents]), torch.cat([timestep, timestep])
            text = torch.cat([text, _rows(batch, "encoder_hidden_states", "uncond")])
        noise = self.pipe.transformer(hidden_states=latents, timestep=timestep, encoder_hidden_states=text,
                                      return_dict=False)[0]
        if guided:
            cond, uncond = noise.chunk(2)
            return _guided(batch, cond, uncond)
        return _split(batch, noise)


class FluxStepper:
    """FluxPipeline's loop (diffusers 0.42), one step for a batch; guidance is an embedding, one branch."""

    def __init__(self, pipe, facts: FamilyFacts, device: torch.device):
        assert facts.family is Family.FLUX, facts.family
        self.pipe, self.device = pipe, device
        self.dtype = pipe.transformer.dtype  # read once, as WanStepper's

    def start(self, encoded, spec, on_step=None) -> StepRequest:
        import numpy as np
        from diffusers.pipelines.flux.pipeline_flux import calculate_shift, retrieve_timesteps

        pipe, device = self.pipe, self.device
        encoded = encoded.to(device)
        dtype = self.dtype  # encode_prompt's dtype when the text encoders are elsewhere
        prompt_embeds = encoded.prompt_embeds.to(dtype)
        latents, image_ids = pipe.prepare_latents(spec.n, pipe.transformer.config.in_channels // 4, spec.height,
                                                  spec.width, prompt_embeds.dtype, device, generator_for(spec), None)
        scheduler = copy.deepcopy(pipe.scheduler)
        config = scheduler.config
        mu = calculate_shift(latents.shape[1], config.get("base_image_seq_len", 256), config.get("max_image_seq_len", 4096),
                             config.get("base_shift", 0.5), config.get("max_shift", 1.15))
        sigmas = None if getattr(config, "use_flow_sigmas", False) else np.linspace(1.0, 1 / spec.steps, spec.steps)
        timesteps, _ = retrieve_timesteps(scheduler, spec.steps, device, sigmas=sigmas, mu=mu)
        scheduler.set_begin_index(0)
        cond = {"encoder_hidden_states": prompt_embeds, "pooled_projections": encoded.pooled_prompt_embeds.to(dtype)}
        if pipe.transformer.config.guidance_embeds:
            cond["guidance"] = torch.full([spec.n], spec.guidance_scale, device=device, dtype=torch.float32)
        shared = {"txt_ids": torch.zeros(prompt_embeds.shape[1], 3, device=device, dtype=dtype), "img_ids": image_ids}
        key = BatchKey(tuple(latents.shape[1:]), latents.dtype, prompt_embeds.shape[1], False)
        return StepRequest(spec, key, scheduler, timesteps, latents, cond, None, on_step, shared)

    def forward(self, batch: list[StepRequest]) -> list[torch.Tensor]:
        latents = torch.cat([r.latents for r in batch])
        timestep = torch.cat([r.timesteps[r.step].expand(r.latents.shape[0]) for r in batch]).to(latents.dtype)
        guidance = _rows(batch, "guidance", "cond") if "guidance" in batch[0].cond else None
        noise = self.pipe.transformer(hidden_states=latents, timestep=timestep / 1000, guidance=guidance,
                                      pooled_projections=_rows(batch, "pooled_projections", "cond"),
                                      encoder_hidden_states=_rows(batch, "encoder_hidden_states", "cond"),
                                      return_dict=False, **batch[0].shared)[0]
        return _split(batch, noise)


def stepper_for(pipe, facts: FamilyFacts, device: torch.device) -> Stepper:
    return (WanStepper if facts.family is Family.WAN else FluxStepper)(pipe, facts, device)
