"""The ingress's two seams: the stage pipeline and the replica board, as small Protocols.

The Serve ingress (:mod:`deployments.ingress.deployment`) binds them to DeploymentHandles and to the
application's residency board actor (which is where each replica's leases and placements are
published); tests bind them to in-process fakes (``tests/deployments/fakes.py``), so the HTTP
behaviour (SSE, error mapping, auth, overload answers, cancellation) is tested without a cluster.
"""
from __future__ import annotations

from typing import AsyncIterator, Awaitable, Protocol

from deployments.api.serving import ServingState
from deployments.capacity.gpu_shares import PendingReplica
from deployments.capacity.replica_report import ReplicaResidency
from deployments.wire.failures import Failure
from deployments.wire.spec import DenoiseProgress, GenerationSpec, StageOutput


class StagePipeline(Protocol):
    """encode -> denoise -> decode for one request; every failure arrives as an exception.

    ``encode`` returns an awaitable that ``denoise`` takes unresolved, so with Serve the prompt
    embeddings go replica to replica through the object store and never through the ingress.
    Cancelling the task that iterates ``denoise`` cancels the denoiser's call (its step loop
    stops at the next step boundary: :class:`deployments.models.cancel.CancelFlag`). With ``progress``
    false it yields the latents only (no caller reads the steps: each event is one more message
    from the replica to the ingress).
    """

    def encode(self, spec: GenerationSpec) -> Awaitable[StageOutput]: ...

    def denoise(self, encoded: Awaitable[StageOutput], spec: GenerationSpec, progress: bool = True
                ) -> AsyncIterator[DenoiseProgress | StageOutput]: ...

    async def decode(self, latents: StageOutput, spec: GenerationSpec) -> StageOutput: ...

    def failure(self, exc: BaseException) -> Failure:
        """What a failed call through this binding means (a stage's, the board's or the job queue's: the
        binding knows its transport's exceptions; the API answers and retries by the kind)."""


class ReplicaBoard(Protocol):
    """What the ingress reads about the live stage replicas (placements and bytes per replica), and
    about the ones Ray has not placed yet (deployments.capacity.unplaced)."""

    async def residency(self) -> tuple[ReplicaResidency, ...]: ...

    async def pending_replicas(self) -> tuple[PendingReplica, ...]: ...


class ServingCheck(Protocol):
    """Whether every stage deployment has a running replica (``deployments.ingress.watch``: Serve's
    status, read every couple of seconds): a cached reading, so the API may ask per request."""

    def state(self) -> ServingState: ...

    async def confirm(self) -> ServingState:
        """``state()`` if it serves, else read afresh: what a refusal is decided on."""
