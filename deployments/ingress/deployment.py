"""The Serve ingress: the HTTP API of :mod:`deployments.api.routes` over DeploymentHandles.

The encoder's response is handed to the denoiser unresolved, so the prompt embeddings go from the
encoder replica to the denoiser replica through Ray's object store; the denoiser streams progress
events and then the latents, which go to the decoder; only decoded frames become PNG/MP4 here.
Everything HTTP lives in :func:`deployments.api.routes.build_api`; this module only binds its two
seams (:mod:`deployments.api.seams`) to Serve.
"""
from __future__ import annotations

import asyncio
import logging
import os
from typing import AsyncIterator, Awaitable

from fastapi import FastAPI
from ray import serve
from ray.serve.handle import DeploymentHandle

from deployments.api.routes import Generated, IngressConfig, build_api
from deployments.api.videos.jobs import JobsBackend
from deployments.capacity import unplaced
from deployments.capacity.gpu_shares import PendingReplica
from deployments.capacity.replica_report import ReplicaResidency
from deployments.ingress.failures import sort_failure
from deployments.ingress.watch import AppWatch
from deployments.jobs.actor import get_job_queue
from deployments.jobs.queue import JobsArgs
from deployments.jobs.results import ResultFolder
from deployments.replica.board import get_board, live_replicas, unpack
from deployments.replica.logs import into_replica_log
from deployments.wire.failures import Failure
from deployments.wire.spec import DenoiseProgress, GenerationSpec, StageOutput

logger = logging.getLogger(__name__)

__all__ = ["Generated", "HandleStages", "Ingress", "IngressConfig", "ResidencyBoardClient"]


class HandleStages:
    """:class:`deployments.api.seams.StagePipeline` over the three stage deployments' handles."""

    def __init__(self, encoder: DeploymentHandle, denoiser: DeploymentHandle, decoder: DeploymentHandle):
        self.encoder, self.denoiser, self.decoder = encoder, denoiser, decoder

    def encode(self, spec: GenerationSpec) -> Awaitable[StageOutput]:
        return self.encoder.encode.remote(spec)

    def failure(self, exc: BaseException) -> Failure:
        return sort_failure(exc)

    def denoise(self, encoded: Awaitable[StageOutput], spec: GenerationSpec, progress: bool = True
                ) -> AsyncIterator[DenoiseProgress | StageOutput]:
        # Cancelling the iterating task cancels this call on the replica (Serve propagates it).
        # Image-to-video and edits: the decoder replica (it holds the VAE) encodes the reference image or
        # the edit's source; its condition goes to the denoiser replica unresolved, as the embeddings do.
        condition = self.decoder.condition.remote(spec) if spec.conditioned else None
        return self.denoiser.options(stream=True).denoise.remote(encoded, spec, progress, condition)

    async def decode(self, latents: StageOutput, spec: GenerationSpec) -> StageOutput:
        return await self.decoder.decode.remote(latents, spec)


class ResidencyBoardClient:
    """:class:`deployments.api.seams.ReplicaBoard` over the application's residency board actor."""

    def __init__(self, app_name: str):
        self.app_name = app_name
        self.board = get_board(app_name)

    async def residency(self) -> tuple[ReplicaResidency, ...]:
        alive = frozenset(await asyncio.to_thread(live_replicas))  # a GCS round trip: off the event loop
        return tuple(unpack(entry) for entry in await self.board.snapshot.remote(alive))

    async def pending_replicas(self) -> tuple[PendingReplica, ...]:
        return await asyncio.to_thread(unplaced.pending_replicas, self.app_name)  # controller + GCS


def serve_backend(app_name: str, args: JobsArgs) -> JobsBackend:
    """The Serve ingress replica's jobs backend: the application's queue actor (get-or-create) and its id."""
    try:
        owner = serve.get_replica_context().replica_id.to_full_id_str()
    except Exception:  # outside a replica (a script building the app by hand)
        owner = f"local-ingress-{os.getpid()}"
    return JobsBackend(get_job_queue(app_name, args), ResultFolder(args.results_location(app_name)), owner)


@serve.deployment(name="Ingress")
@serve.ingress()
class Ingress:
    """Validates requests, drives encoder -> denoiser -> decoder, and encodes the frames."""

    def __init__(self, encoder: DeploymentHandle, denoiser: DeploymentHandle, decoder: DeploymentHandle,
                 config: IngressConfig):
        into_replica_log()  # this process also runs the Denoiser's router: its lines too
        self.stages = HandleStages(encoder, denoiser, decoder)
        self.config = config
        self.board = ResidencyBoardClient(config.app_name)
        self.jobs = serve_backend(config.app_name, config.jobs)
        self.watch = AppWatch(config.app_name)  # which stages run (health, refusals) and pending replicas
        logger.info("ingress for %s (%s, %s): auth %s, CORS origins %s, limits %s", config.model_id,
                    config.facts.family.value, config.facts.folder, "bearer token" if config.api_token else "off",
                    list(config.cors_origins) or "none", config.limits)

    def __serve_build_asgi_app__(self) -> FastAPI:
        return build_api(self.config, self.stages, self.board, self.jobs, self.watch)
