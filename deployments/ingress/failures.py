"""Ray's and Serve's exceptions sorted into :class:`~deployments.wire.failures.Failure` kinds, in the ingress replica.

The HTTP API and the job runner receive :func:`sort_failure` through their seams, so they never
import Ray; tests bind the same function to their fakes, which raise Ray's own exceptions.
"""
from __future__ import annotations

from ray import exceptions as ray_errors
from ray.serve import exceptions as serve_errors

from cluster.replica.ledger_view import DeviceBusy
from deployments.wire.failures import Failure, FailureKind, causes
from deployments.wire.spec import NonFiniteOutput, RankLost, RequestRejected
from offload_core.streaming.copier import CopyFailed

# Gone or going replicas: Serve replaces them; the client should retry.
_UNAVAILABLE = (ray_errors.RayActorError, ray_errors.ActorDiedError, ray_errors.ActorUnavailableError,
                serve_errors.ReplicaUnavailableError, serve_errors.DeploymentUnavailableError,
                serve_errors.RequestCancelledError, ray_errors.ObjectLostError,
                RankLost)  # a tensor-parallel replica lost a rank: it fails its health check and is replaced


def sort_failure(exc: BaseException) -> Failure:
    """The first link of ``exc``'s chain that says what went wrong decides; OTHER when none does."""
    for cause in causes(exc):
        if isinstance(cause, RequestRejected):
            return Failure(FailureKind.REJECTED, cause)
        if isinstance(cause, serve_errors.BackPressureError):
            return Failure(FailureKind.QUEUE_FULL, cause)
        if isinstance(cause, DeviceBusy):
            return Failure(FailureKind.DEVICE_BUSY, cause, cause.retry_after_s)
        if isinstance(cause, _UNAVAILABLE):
            return Failure(FailureKind.LOST_REPLICA, cause)
        if isinstance(cause, CopyFailed):
            return Failure(FailureKind.COPY_FAILED, cause)
        if isinstance(cause, NonFiniteOutput):
            return Failure(FailureKind.BAD_OUTPUT, cause)
    return Failure(FailureKind.OTHER, exc)
