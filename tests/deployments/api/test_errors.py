"""Overload and lost replicas become 503 with Retry-After, even wrapped in Ray's task errors."""
from __future__ import annotations

import json
import pickle

from ray import exceptions as ray_errors
from ray.serve.exceptions import BackPressureError

from cluster.replica.ledger_view import DeviceBusy
from deployments.api import errors
from deployments.ingress.failures import sort_failure
from deployments.wire.spec import NonFiniteOutput
from offload_core.host.budget import Refusal
from offload_core.streaming.copier import CopyFailed, FillTimeout


def _body(response) -> dict:
    return json.loads(response.body)


def _busy(owner: str, nbytes: int, available: int, waited_s: float) -> DeviceBusy:
    return DeviceBusy(owner, "gpu:0", nbytes, Refusal(owner, nbytes, available, "full"), waited_s)


def test_device_busy_survives_pickling_with_its_figures():
    # Raised in the stage replica, read by the ingress: it crosses Ray pickled.
    busy = pickle.loads(pickle.dumps(_busy("denoise#1", 1000, 10, 2.5)))
    assert (busy.owner, busy.pool, busy.nbytes, busy.available, busy.waited_s, busy.retry_after_s) == (
        "denoise#1", "gpu:0", 1000, 10, 2.5, 3)
    assert busy.refusal.reason == "full"


def test_device_busy_inside_a_ray_task_error_is_a_503_with_the_longer_retry_after():
    wrapped = ray_errors.RayTaskError("decode", "traceback", _busy("decode#1", 5, 0, 3.5))
    response = errors.overload_or_failure(sort_failure(wrapped), retry_after_s=2, request_id="r1")
    assert response.status_code == 503 and response.headers["retry-after"] == "4"
    assert _body(response)["error"]["code"] == "device_busy"


def test_a_full_queue_is_a_503_with_retry_after():
    response = errors.overload_or_failure(sort_failure(BackPressureError(num_queued_requests=3, max_queued_requests=2)),
                                          retry_after_s=2, request_id="r2")
    assert response.status_code == 503 and response.headers["retry-after"] == "2"
    assert _body(response)["error"]["code"] == "queue_full"


def test_a_dead_replica_is_a_503_and_anything_else_a_logged_500():
    died = errors.overload_or_failure(sort_failure(ray_errors.ActorDiedError()), retry_after_s=1, request_id="r3")
    assert died.status_code == 503 and _body(died)["error"]["code"] == "replica_unavailable"
    other = errors.overload_or_failure(sort_failure(RuntimeError("bug")), retry_after_s=1, request_id="r4")
    assert other.status_code == 500 and "r4" in _body(other)["error"]["message"]


def test_a_failed_or_timed_out_weight_copy_in_a_ray_task_error_is_a_503_with_retry_after():
    for error in (CopyFailed("copying streamed layer blocks.3 to cuda:0 failed: OSError: EIO"),
                  FillTimeout("staging fill of layer blocks.3 not done after 30.0 s (fill_timeout_s)")):
        wrapped = ray_errors.RayTaskError("denoise", "traceback", error)
        response = errors.overload_or_failure(sort_failure(wrapped), retry_after_s=2, request_id="r1")
        assert response.status_code == 503 and response.headers["retry-after"] == "2"
        body = _body(response)["error"]
        assert body["code"] == "copy_failed" and type(error).__name__ in body["message"]


def test_non_finite_output_in_a_ray_task_error_is_a_500_saying_what_and_the_request():
    cause = NonFiniteOutput("the decoder made 7 of 12 output values NaN or infinite in float16")
    response = errors.overload_or_failure(sort_failure(ray_errors.RayTaskError("decode", "tb", cause)),
                                          retry_after_s=2, request_id="r9")
    body = _body(response)["error"]
    assert response.status_code == 500 and response.headers["x-request-id"] == "r9"
    assert body["code"] == "non_finite_output" and body["type"] == "server_error"
    assert body["message"] == "request r9: the decoder made 7 of 12 output values NaN or infinite in float16"
