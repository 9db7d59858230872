"""Why a call to another process failed, as kinds the ingress answers and the job runner retries by.

The sorting itself knows the transport (Ray's and Serve's exceptions: :mod:`deployments.ingress.failures`);
the HTTP API and the runner see only :class:`Failure`, through :class:`FailureSorter`, so they import no Ray.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Iterator, Protocol


class FailureKind(enum.Enum):
    REJECTED = "rejected"  # a stage refused the request itself (RequestRejected): a 4xx naming the field
    QUEUE_FULL = "queue_full"  # a stage's queue was full: try later
    DEVICE_BUSY = "device_busy"  # the device lease was not granted in time: try later
    LOST_REPLICA = "lost_replica"  # the replica or actor died or went away mid-call: rerun elsewhere
    # The replica's engine could not copy a layer to the device (an I/O error, a fill past its bounded
    # wait): its slots and buffers were given back, it stays usable; the client may retry.
    COPY_FAILED = "copy_failed"
    # The decoder made non-finite values (NonFiniteOutput): a fault the same seed repeats, said as a 500
    # naming it (the request id and the fix), not rerun.
    BAD_OUTPUT = "bad_output"
    OTHER = "other"  # anything else: a fault, not worth a rerun

    @property
    def overload(self) -> bool:
        return self in (FailureKind.QUEUE_FULL, FailureKind.DEVICE_BUSY)


@dataclass(frozen=True)
class Failure:
    """One sorted failure: its kind and the exception in the chain that decided it (the exception itself for OTHER)."""

    kind: FailureKind
    cause: BaseException
    retry_after_s: int = 0  # DEVICE_BUSY: how long the lease waited, the least a client should wait


class FailureSorter(Protocol):
    def __call__(self, exc: BaseException) -> Failure: ...


def causes(exc: BaseException | None, depth: int = 5) -> Iterator[BaseException]:
    """``exc`` and what caused it (Ray's ``cause`` or Python's ``__cause__``), at most ``depth`` links."""
    seen = 0
    while exc is not None and seen < depth:
        yield exc
        exc = getattr(exc, "cause", None) or exc.__cause__
        seen += 1
