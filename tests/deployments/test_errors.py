"""Overload and lost replicas become 503 with Retry-After, even wrapped in Ray's task errors."""
from __future__ import annotations

import json
import pickle

from ray import exceptions as ray_errors
from ray.serve.exceptions import BackPressureError

from cluster import replica_memory
from deployments import errors
from deployments.memory import DeviceBusy
from offload_core.host.budget import Refusal


def _body(response) -> dict:
    return json.loads(response.body)


def test_device_busy_survives_pickling_with_its_figures():
    busy = pickle.loads(pickle.dumps(DeviceBusy("denoise#1", 1000, 10, 2.5, 3)))
    assert (busy.owner, busy.nbytes, busy.available, busy.waited_s, busy.retry_after_s) == ("denoise#1", 1000, 10, 2.5, 3)


def test_the_clusters_device_busy_converts_with_its_retry_hint():
    cluster_busy = replica_memory.DeviceBusy("denoise#1", "gpu:0", 1000, Refusal("denoise#1", 1000, 10, "full"), 2.5)
    busy = DeviceBusy.from_cluster(cluster_busy)
    assert (busy.nbytes, busy.available, busy.retry_after_s) == (1000, 10, cluster_busy.retry_after_s)


def test_device_busy_inside_a_ray_task_error_is_a_503_with_the_longer_retry_after():
    wrapped = ray_errors.RayTaskError("decode", "traceback", DeviceBusy("decode#1", 5, 0, 1.0, 4))
    response = errors.overload_or_failure(wrapped, retry_after_s=2, request_id="r1")
    assert response.status_code == 503 and response.headers["retry-after"] == "4"
    assert _body(response)["error"]["code"] == "device_busy"


def test_a_full_queue_is_a_503_with_retry_after():
    response = errors.overload_or_failure(BackPressureError(num_queued_requests=3, max_queued_requests=2),
                                          retry_after_s=2, request_id="r2")
    assert response.status_code == 503 and response.headers["retry-after"] == "2"
    assert _body(response)["error"]["code"] == "queue_full"


def test_a_dead_replica_is_a_503_and_anything_else_a_logged_500():
    died = errors.overload_or_failure(ray_errors.ActorDiedError(), retry_after_s=1, request_id="r3")
    assert died.status_code == 503 and _body(died)["error"]["code"] == "replica_unavailable"
    other = errors.overload_or_failure(RuntimeError("bug"), retry_after_s=1, request_id="r4")
    assert other.status_code == 500 and "r4" in _body(other)["error"]["message"]
