"""Every failure the ingress can see, as an OpenAI-style JSON error with the right status (no Ray here:
failures arrive sorted, :class:`deployments.wire.failures.Failure`).

Bad input is a 4xx naming the field; overload (Serve's queue full, the device lease not granted in
time, a stage replica gone mid-call) is a 503 with Retry-After, so clients back off and retry
instead of treating it as a server fault.
"""
from __future__ import annotations

import logging

from fastapi.responses import JSONResponse
from pydantic import ValidationError

from deployments.capacity.request_limits import FieldError
from deployments.wire.failures import Failure, FailureKind

logger = logging.getLogger(__name__)

# A message or param echoes what the client sent (an unknown key, a path); 500 characters are
# enough to recognise it, and the bound keeps a 1 MiB key out of the answer and the log.
_MAX_ECHO_CHARS = 500


def _printable(text: str | None) -> str | None:
    """Text that encodes as UTF-8: a lone surrogate in an echoed key would make the answer a 500."""
    if text is None:
        return None
    text = text if len(text) <= _MAX_ECHO_CHARS else text[:_MAX_ECHO_CHARS] + "..."
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def error_json(status: int, message: str, param: str | None, code: str, kind: str,
               headers: dict[str, str] | None = None) -> JSONResponse:
    """The OpenAI error object: ``{"error": {"message", "type", "param", "code"}}``."""
    body = {"error": {"message": _printable(message), "type": kind, "param": _printable(param), "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)


def field_error(error: FieldError) -> JSONResponse:
    return error_json(error.status, error.message, error.param, error.code, "invalid_request_error")


def validation_error(error: ValidationError) -> JSONResponse:
    first = error.errors()[0]
    param = ".".join(str(part) for part in first["loc"]) or "body"
    code = "unknown_field" if first["type"] == "extra_forbidden" else "invalid_value"
    return error_json(400, f"{param}: {first['msg']}", param, code, "invalid_request_error")


def internal_error(request_id: str, exc: BaseException) -> JSONResponse:
    """A 500 whose body carries the request id that the logged traceback also carries."""
    logger.error("request %s failed: %s: %s", request_id, type(exc).__name__, exc, exc_info=exc)
    return error_json(500, f"internal error in request {request_id}; the server log has the details", None,
                      "internal_error", "server_error", {"X-Request-Id": request_id})


def overload_or_failure(failure: Failure, retry_after_s: int, request_id: str) -> JSONResponse:
    """4xx for request-caused stage errors, 503 + Retry-After for overload, lost replicas and failed
    weight copies (the engine's CopyFailed / FillTimeout: the replica gave everything back); 500 naming
    non-finite output (NonFiniteOutput); 500 (logged with the request id) for anything else."""
    retry = {"Retry-After": str(retry_after_s)}
    cause, kind = failure.cause, failure.kind
    if kind is FailureKind.REJECTED:
        logger.info("request %s refused by a stage: %s; %d", request_id, cause, cause.status)
        return error_json(cause.status, cause.message, cause.param, "invalid_value", "invalid_request_error")
    if kind is FailureKind.QUEUE_FULL:
        logger.info("request %s refused: stage queue full (%s); 503, retry after %d s",
                    request_id, cause, retry_after_s)
        return error_json(503, "server busy: the queue is full, retry later", None, "queue_full",
                          "overloaded", retry)
    if kind is FailureKind.DEVICE_BUSY:
        wait = max(retry_after_s, failure.retry_after_s)
        logger.info("request %s refused: %s; 503, retry after %d s", request_id, cause, wait)
        return error_json(503, f"device busy: {cause}", None, "device_busy", "overloaded",
                          {"Retry-After": str(wait)})
    if kind is FailureKind.LOST_REPLICA:
        logger.info("request %s lost its stage replica (%s); 503, retry after %d s",
                    request_id, type(cause).__name__, retry_after_s)
        return error_json(503, "a stage replica was lost mid-request and is being replaced; retry",
                          None, "replica_unavailable", "overloaded", retry)
    if kind is FailureKind.COPY_FAILED:
        logger.warning("request %s failed copying weights to the device (%s: %s); 503, retry after %d s",
                       request_id, type(cause).__name__, cause, retry_after_s)
        return error_json(503, f"the replica could not copy weights to the device ({type(cause).__name__}); "
                          "it is usable again, retry", None, "copy_failed", "overloaded", retry)
    if kind is FailureKind.BAD_OUTPUT:
        logger.error("request %s: %s; 500", request_id, cause)
        return error_json(500, f"request {request_id}: {cause}", None, "non_finite_output", "server_error",
                          {"X-Request-Id": request_id})
    return internal_error(request_id, cause)
