"""In-process fakes of the ingress's seams (deployments.api.seams), for HTTP tests without a cluster.

``FakeStages`` answers like the real stages (progress per step, then latents; frames of the asked
size), records every call, and can be told to fail a stage with a given exception or to hold the
denoiser at a step until released, so SSE, error mapping and cancellation can be observed.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import torch

from deployments.api.routes import IngressConfig, build_api
from deployments.capacity.gpu_shares import PendingReplica
from deployments.capacity.replica_report import ReplicaResidency
from deployments.capacity.request_limits import Limits
from deployments.ingress.failures import sort_failure
from deployments.models.families import read_family_traits
from deployments.wire.failures import Failure
from deployments.wire.spec import DenoiseProgress, EncodedPrompt, GenerationSpec, StageOutput, StageStats
from zoo.tiny import ensure_tiny_wan

TOKEN = "fake-token"
LIMITS = Limits(max_width=64, max_height=64, max_steps=8, max_n=2, max_prompt_chars=200, max_frames=9,
                default_size="16x16", default_steps=2, default_frames=5, default_fps=4)


def _stats(stage: str) -> StageStats:
    return StageStats(stage, f"fake-{stage}", 0.001, 10, 20)


@dataclass
class FakeStages:
    """deployments.api.seams.StagePipeline in process. ``fail``: stage name ("encode", "denoise",
    "decode", or "preview" for a preview's decode) -> exception to raise."""

    fail: dict[str, BaseException] = field(default_factory=dict)
    # When set, the denoiser waits on it before every step after the first (a slow step).
    hold: asyncio.Event | None = None
    calls: list[tuple[str, str]] = field(default_factory=list)  # (stage, request id)
    steps_done: dict[str, int] = field(default_factory=dict)
    cancelled: list[str] = field(default_factory=list)  # request ids whose denoise was cancelled
    specs: dict[str, GenerationSpec] = field(default_factory=dict)  # request id -> its spec, as encode got it

    def _maybe_fail(self, stage: str) -> None:
        if stage in self.fail:
            raise self.fail[stage]

    def encode(self, spec: GenerationSpec):
        self.calls.append(("encode", spec.request_id))
        self.specs[spec.request_id] = spec

        async def run() -> StageOutput:
            self._maybe_fail("encode")
            return StageOutput(EncodedPrompt(torch.zeros(spec.n, 4, 8)), _stats("encode"))

        return asyncio.ensure_future(run())

    async def denoise(self, encoded, spec: GenerationSpec, progress: bool = True):
        self.calls.append(("denoise", spec.request_id))
        enc = await encoded
        try:
            for step in range(1, spec.run_steps + 1):
                if step > 1 and self.hold is not None:
                    await self.hold.wait()
                self._maybe_fail("denoise")
                self.steps_done[spec.request_id] = step
                if progress:  # a preview's latents are filled with the fraction of steps done
                    preview = torch.full(self._latent_shape(spec), step / spec.run_steps) \
                        if step in spec.preview_steps else None
                    yield DenoiseProgress(spec.request_id, step, spec.run_steps, preview)
        except (asyncio.CancelledError, GeneratorExit):
            self.cancelled.append(spec.request_id)
            raise
        # As the Denoiser's: the latents come after the step loop (a reader that stops there cancels nothing).
        yield StageOutput(torch.zeros(self._latent_shape(spec)), _stats("denoise")).after(enc)

    @staticmethod
    def _latent_shape(spec: GenerationSpec) -> tuple[int, ...]:
        return spec.n, 4, 1, max(1, spec.height // 8), max(1, spec.width // 8)  # never empty: a 4x4 edit is valid

    def failure(self, exc: BaseException) -> Failure:
        return sort_failure(exc)  # the ingress's own sorting: the fakes raise Ray's exceptions

    async def decode(self, latents: StageOutput, spec: GenerationSpec) -> StageOutput:
        self.calls.append(("decode", spec.request_id))
        self._maybe_fail("preview" if latents.stats.replica == "preview" else "decode")
        # A gradient, so PNG/MP4 encoding has something to encode; a preview's dimmed by its latents' fill.
        ramp = torch.linspace(0, 1, spec.width).expand(spec.n, spec.num_frames, spec.height, spec.width)
        ramp = ramp * (1 - latents.value.flatten()[0].item())
        return StageOutput(ramp.unsqueeze(-1).expand(-1, -1, -1, -1, 3).contiguous(), _stats("decode")).after(latents)


@dataclass
class FakeBoard:
    """deployments.api.seams.ReplicaBoard in process."""

    reports: tuple[ReplicaResidency, ...] = ()
    pending: tuple[PendingReplica, ...] = ()  # replicas Ray has not placed

    async def residency(self) -> tuple[ReplicaResidency, ...]:
        return self.reports

    async def pending_replicas(self) -> tuple[PendingReplica, ...]:
        return self.pending


def fake_config(token: str | None = TOKEN, cors: tuple[str, ...] = (), folder=ensure_tiny_wan) -> IngressConfig:
    """``folder``: the zoo model whose configs (sizes, family) the API validates by; its weights are never read."""
    facts = read_family_traits(folder())
    return IngressConfig("fake-app", facts.folder.rsplit("/", 1)[-1], facts, LIMITS, token, 1, cors)


def fake_api(stages: FakeStages | None = None, token: str | None = TOKEN, cors: tuple[str, ...] = (),
             folder=ensure_tiny_wan):
    """(FastAPI app, its FakeStages) with the fake board, validating as ``folder``'s family (tiny Wan)."""
    stages = stages if stages is not None else FakeStages()
    return build_api(fake_config(token, cors, folder), stages, FakeBoard()), stages
