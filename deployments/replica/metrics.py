"""Prometheus metrics through Ray Serve's metrics API (exported by Ray's metrics agent).

One object per stage replica, so every series carries the stage tag; Serve adds the deployment,
replica and application tags itself.
"""
from __future__ import annotations

from ray.serve import metrics

from deployments.replica.batching import ForwardFigures
from deployments.wire.spec import StageStats

# Stage latency buckets: 10 ms (tiny zoo, one encoder call) to 10 min (a 14B denoiser, 50 steps).
LATENCY_BUCKETS_S = [0.01, 0.03, 0.1, 0.3, 1.0, 3.0, 10.0, 30.0, 100.0, 300.0, 600.0]
# Bytes streamed per request: 1 MiB (tiny zoo) to 1 TiB (a 28 GB denoiser streamed 2 x 50 times).
BYTES_BUCKETS = [float(1 << shift) for shift in range(20, 41, 2)]


class StageMetrics:
    def __init__(self, stage: str):
        tags = ("stage",)
        self._latency = metrics.Histogram(
            "offload_serve_stage_latency_seconds", description="Wall time of one stage call.",
            boundaries=LATENCY_BUCKETS_S, tag_keys=tags)
        self._streamed = metrics.Histogram(
            "offload_serve_bytes_streamed_per_request", description="Host->device weight bytes per stage call.",
            boundaries=BYTES_BUCKETS, tag_keys=tags)
        self._streamed_total = metrics.Counter(
            "offload_serve_bytes_streamed_total", description="Host->device weight bytes, all calls.", tag_keys=tags)
        self._peak = metrics.Gauge(
            "offload_serve_device_peak_bytes", description="Peak weight bytes on the device in the last call.",
            tag_keys=tags)
        self._cancelled = metrics.Counter(
            "offload_serve_cancelled_requests_total", description="Calls stopped because their caller went away.",
            tag_keys=tags)
        self._steps_after_cancel = metrics.Gauge(
            "offload_serve_steps_after_cancel", description="Steps run after the last one the caller saw, in the "
            "last cancelled call (at most 1: the loop stops at the next step boundary).", tag_keys=tags)
        self._free_after_cancel = metrics.Gauge(
            "offload_serve_free_seconds_after_cancel", description="Seconds from the cancel to the replica being "
            "free (lease and call lock given back), last cancelled call.", tag_keys=tags)
        for metric in (self._latency, self._streamed, self._streamed_total, self._peak, self._cancelled,
                       self._steps_after_cancel, self._free_after_cancel):
            metric.set_default_tags({"stage": stage})

    def record(self, stats: StageStats) -> None:
        self._latency.observe(stats.seconds)
        self._streamed.observe(float(stats.bytes_streamed))
        if stats.bytes_streamed > 0:  # Ray counters refuse increments of 0 (a resident plan moves nothing)
            self._streamed_total.inc(float(stats.bytes_streamed))
        self._peak.set(float(stats.device_peak_bytes))

    def record_cancel(self, steps_after: int, free_s: float) -> None:
        self._cancelled.inc()
        self._steps_after_cancel.set(float(steps_after))
        self._free_after_cancel.set(free_s)


# Requests per forward: 1 to 64.
BATCH_BUCKETS = [1.0, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 16.0, 32.0, 64.0]


class BatchMetrics:
    """The Denoiser's step batching: batch size, queue wait, step time."""

    def __init__(self):
        self._size = metrics.Histogram(
            "offload_serve_batch_size", description="Requests sharing one denoiser forward.",
            boundaries=BATCH_BUCKETS)
        self._wait = metrics.Histogram(
            "offload_serve_batch_queue_wait_seconds", description="Wait for room in a compatible batch.",
            boundaries=LATENCY_BUCKETS_S)
        self._step = metrics.Histogram(
            "offload_serve_step_seconds", description="One batched denoiser forward and its scheduler steps.",
            boundaries=LATENCY_BUCKETS_S)

    def record_forward(self, figures: ForwardFigures) -> None:
        self._size.observe(float(figures.requests))
        self._step.observe(figures.seconds)

    def record_wait(self, seconds: float) -> None:
        self._wait.observe(seconds)
