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

import contextlib
import logging
from dataclasses import dataclass, field
from typing import Callable, ClassVar, Protocol

import torch

from deployments.models.adapter import FamilyTraits
from deployments.models.cancel import CancelFlag
from deployments.models.step_cache import BlockForm, CachedRequest, step_cache_for
from deployments.wire.spec import DenoiseProgress, EncodedPrompt, GenerationSpec

logger = logging.getLogger(__name__)


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
    # Its step cache state: threshold (0: off), residuals per transformer, steps skipped.
    cache: CachedRequest = field(default_factory=CachedRequest)
    # The family's last touch on the final latents, after the last step (Wan2.2 TI2V-5B's
    # image-to-video puts the reference frame's latents back, as its pipeline does); None: as stepped.
    finish: Callable[[torch.Tensor], torch.Tensor] | None = None
    # A touch after every step, before ``finish`` (an inpainting edit puts the image back outside its
    # mask, noised to the next step: deployments.models.edits.inpaint); None: as stepped.
    blend: Callable[[torch.Tensor], torch.Tensor] | None = None
    # A preview's touch (an inpainting edit's: the image itself outside its mask, as the final latents
    # have it); None: the estimate as is.
    keep: Callable[[torch.Tensor], torch.Tensor] | None = None

    @property
    def rows(self) -> int:
        """Transformer rows this request adds to a forward (both branches when guided)."""
        return self.latents.shape[0] * (2 if self.uncond is not None else 1)

    @property
    def done(self) -> bool:
        return self.step >= len(self.timesteps)

    def advance(self, noise_pred: torch.Tensor) -> None:
        t, sample = self.timesteps[self.step], self.latents
        self.latents = self.scheduler.step(noise_pred, t, sample, return_dict=False)[0]
        self.step += 1
        if self.blend is not None:
            self.latents = self.blend(self.latents)
        if self.done and self.finish is not None:
            self.latents = self.finish(self.latents)
        if self.on_step is not None:
            preview, ready = self.preview(sample, noise_pred) if self.step in self.spec.preview_steps else (None, None)
            self.on_step(DenoiseProgress(self.spec.request_id, self.step, len(self.timesteps), preview, ready))

    def preview(self, sample: torch.Tensor, noise_pred: torch.Tensor) -> tuple[torch.Tensor, object | None]:
        """(the step's estimate of the final latents on the CPU, for a preview image; on CUDA the event
        its copy completes at, else None).

        Every served family's scheduler integrates a flow (``x_t = (1 - sigma) x_0 + sigma noise``, the
        model predicting ``noise - x_0``), so ``x_0 = x_t - sigma_t v`` with the step's sigma: a
        recognisable image from the first steps, where the stepped latents are still mostly noise. Any
        other scheduler (a family added later) gives the stepped latents. Reads the scheduler, changes
        nothing."""
        sigmas, index = getattr(self.scheduler, "sigmas", None), getattr(self.scheduler, "step_index", None)
        if not integrates_flow(self.scheduler) or sigmas is None or index is None:
            estimate = self.latents
        else:  # step() advanced step_index past the sigma it used
            estimate = sample.float() - sigmas[index - 1].item() * noise_pred.float()
            estimate = estimate.to(self.latents.dtype)
            if self.keep is not None:
                estimate = self.keep(estimate)
            if self.finish is not None:
                estimate = self.finish(estimate)
        return host_copy(estimate)


def host_copy(tensor: torch.Tensor) -> tuple[torch.Tensor, object | None]:
    """``tensor`` copied to the host, and on CUDA the event recorded after the copy. From CUDA the copy is
    non-blocking (torch lands it in pinned memory from its caching host allocator: a latent, ~1 MB at
    1024x1024): a blocking one would stall the batch's thread until the GPU drained the step it just
    queued, where the next step's launches and prefetches should already be going."""
    if tensor.device.type != "cuda":
        return tensor.to("cpu", copy=True), None
    host = tensor.to("cpu", non_blocking=True)
    event = torch.cuda.Event()
    event.record()  # on the current stream, after the copy
    return host, event


def integrates_flow(scheduler) -> bool:
    """Whether ``scheduler`` steps a flow-matching model (its output ``noise - x_0``): diffusers'
    FlowMatch* schedulers, or a multistep one told ``prediction_type: flow_prediction`` (Wan's UniPC)."""
    config = getattr(scheduler, "config", {})
    return type(scheduler).__name__.startswith("FlowMatch") or config.get("prediction_type") == "flow_prediction"


class Stepper(Protocol):
    """A family's half of step batching: start a request, run one forward for a batch of them."""

    def start(self, encoded: EncodedPrompt, spec: GenerationSpec,
              on_step: Callable[[DenoiseProgress], None] | None = None) -> StepRequest: ...

    def forward(self, batch: list[StepRequest]) -> list[torch.Tensor]: ...


class TransformerStepper:
    """The shared start of a one-transformer family's stepper: its pipeline, its device, and the
    transformer's dtype read once (ModelMixin.dtype walks the parameters: a quarter of the tiny Wan's
    step time when read per forward). ``family``: the name its log lines give."""

    family: ClassVar[str] = ""

    def __init__(self, pipe, facts: FamilyTraits, device: torch.device):
        self.pipe, self.device = pipe, device
        self.dtype = pipe.transformer.dtype


def step_alone(stepper, request: StepRequest) -> torch.Tensor:
    """``request`` stepped to its end by ``stepper`` alone (one forward a step, guidance's branches as the
    stepper runs them), under ``no_grad`` as StepBatch steps: its final latents."""
    with torch.no_grad():
        while not request.done:
            request.advance(stepper.forward([request])[0])
    return request.latents


def rows_of(batch: list[StepRequest], name: str, branch: str) -> torch.Tensor:
    """``name`` of every request's ``branch`` ("cond"/"uncond") inputs, concatenated in batch order."""
    return torch.cat([getattr(r, branch)[name] for r in batch])


def guided_noise(batch: list[StepRequest], cond: torch.Tensor, uncond: torch.Tensor) -> list[torch.Tensor]:
    """Each request's guided noise from its rows of the batched output, with its own scale."""
    out, start = [], 0
    for r in batch:
        n = r.latents.shape[0]
        c, u = cond[start:start + n], uncond[start:start + n]
        out.append(u + r.spec.guidance_scale * (c - u))
        start += n
    return out


def request_rows(batch: list[StepRequest], guided: bool) -> list[list[int]]:
    """Each request's rows in the forward's batch: its conditional rows, then (guided) its
    unconditional ones, which follow every request's conditional rows (``cat([cond, uncond])``)."""
    rows, start, total = [], 0, sum(r.latents.shape[0] for r in batch)
    for r in batch:
        n = r.latents.shape[0]
        rows.append(list(range(start, start + n)) + (list(range(total + start, total + start + n)) if guided else []))
        start += n
    return rows


def cached(transformer, batch: list[StepRequest], guided: bool, form: BlockForm | None = None):
    """The step cache around one transformer call of ``batch`` (the plain call when every threshold is 0).
    ``guided``: each request's rows are in both halves of the batch (cond and uncond, in either order);
    ``form``: the family's transformer block (None: Wan's or Flux's, told by the block signature)."""
    if not any(r.cache.threshold > 0 for r in batch):
        return contextlib.nullcontext()
    return step_cache_for(transformer, form).active([r.cache for r in batch], request_rows(batch, guided))


def uncached(batch: list[StepRequest], family: str) -> None:
    """For a family whose stepper runs no step cache: say so once per request that asked for one
    (at its first step), so a threshold is never ignored silently; every block runs."""
    for r in batch:
        if r.cache.threshold > 0 and r.step == 0:
            logger.info("request %s: cache_threshold %.3g ignored: the step cache is not implemented for the %s "
                        "family; every block runs each step", r.spec.request_id, r.cache.threshold, family)


def split_noise(batch: list[StepRequest], noise: torch.Tensor) -> list[torch.Tensor]:
    return list(noise.split([r.latents.shape[0] for r in batch]))


def stepper_for(pipe, facts: FamilyTraits, device: torch.device) -> Stepper:
    """The family's stepper (its adapter's, ``deployments/models/<family>.py``)."""
    from deployments.models.registry import adapter_for

    return adapter_for(facts).stepper(pipe, facts, device)
