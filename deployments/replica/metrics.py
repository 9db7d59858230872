"""Prometheus metrics through Ray Serve's metrics API (exported by Ray's metrics agent).

One object per stage replica, so every series carries the stage tag; Serve adds the deployment,
replica and application tags itself.
"""
from __future__ import annotations

from ray.serve import metrics
from ray.util import metrics as ray_metrics

from deployments.replica.batching import ForwardFigures
from deployments.wire.spec import StageStats

# Stage latency buckets: 10 ms (tiny zoo, one encoder call) to 10 min (a 14B denoiser, 50 steps).
LATENCY_BUCKETS_S = [0.01, 0.03, 0.1, 0.3, 1.0, 3.0, 10.0, 30.0, 100.0, 300.0, 600.0]
# Bytes streamed per request: 1 MiB (tiny zoo) to 1 TiB (a 28 GB denoiser streamed 2 x 50 times).
BYTES_BUCKETS = [float(1 << shift) for shift in range(20, 41, 2)]
# Ray refuses a boundary of 0: a request that skipped nothing lands in the first bucket (<= 0.1).
SKIP_FRACTION_BUCKETS = [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0]


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
        # Per component: Wan2.2 A14B's Denoiser streams two experts, each counted on its own.
        self._component_total = metrics.Counter(
            "offload_serve_component_bytes_streamed_total", description="Host->device weight bytes per component, "
            "all calls.", tag_keys=("stage", "component"))
        self._cache_skips = metrics.Counter(
            "offload_serve_step_cache_skips_total", description="Denoising steps whose blocks after the first "
            "the step cache skipped (with their copies when the whole batch skipped).", tag_keys=tags)
        self._cache_skip_fraction = metrics.Histogram(
            "offload_serve_step_cache_skip_fraction", description="Per request: skipped steps / steps.",
            boundaries=SKIP_FRACTION_BUCKETS, tag_keys=tags)
        for metric in (self._latency, self._streamed, self._streamed_total, self._peak, self._cancelled,
                       self._steps_after_cancel, self._free_after_cancel, self._component_total, self._cache_skips,
                       self._cache_skip_fraction):
            metric.set_default_tags({"stage": stage})
        self._stage = stage

    def record_compile(self, figures) -> None:
        """Compile seconds per bucket (and component) at the replica's start (compile: blocks)."""
        gauge = metrics.Gauge("offload_serve_compile_seconds", description="Seconds one bucket's compiled "
                              "warm-up call took at the replica's start (compile included).",
                              tag_keys=("stage", "bucket"))
        gauge.set_default_tags({"stage": self._stage})
        for figure in figures:
            gauge.set(figure.compile_s, tags={"bucket": figure.bucket})

    def record(self, stats: StageStats) -> None:
        self._latency.observe(stats.seconds)
        self._streamed.observe(float(stats.bytes_streamed))
        if stats.bytes_streamed > 0:  # Ray counters refuse increments of 0 (a resident plan moves nothing)
            self._streamed_total.inc(float(stats.bytes_streamed))
        self._peak.set(float(stats.device_peak_bytes))
        if stats.steps:
            self._cache_skip_fraction.observe(stats.cache_skips / stats.steps)
        if stats.cache_skips:  # Ray counters refuse increments of 0
            self._cache_skips.inc(float(stats.cache_skips))

    def record_components(self, nbytes: dict[str, int]) -> None:
        for component, moved in nbytes.items():
            if moved > 0:  # Ray counters refuse increments of 0
                self._component_total.inc(float(moved), tags={"component": component})

    def record_cancel(self, steps_after: int, free_s: float) -> None:
        self._cancelled.inc()
        self._steps_after_cancel.set(float(steps_after))
        self._free_after_cancel.set(free_s)


# Requests per forward: 1 to 64.
BATCH_BUCKETS = [1.0, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 16.0, 32.0, 64.0]


class BatchMetrics:
    """The Denoiser's step batching: batch size, queue wait, step time (by GPU type: on a mixed fleet one
    deployment's replicas step at their own GPU's speed)."""

    def __init__(self, gpu_type: str = "unknown"):
        self._size = metrics.Histogram(
            "offload_serve_batch_size", description="Requests sharing one denoiser forward.",
            boundaries=BATCH_BUCKETS)
        self._wait = metrics.Histogram(
            "offload_serve_batch_queue_wait_seconds", description="Wait for room in a compatible batch.",
            boundaries=LATENCY_BUCKETS_S)
        self._step = metrics.Histogram(
            "offload_serve_step_seconds", description="One batched denoiser forward and its scheduler steps.",
            boundaries=LATENCY_BUCKETS_S, tag_keys=("gpu_type",))
        self._step.set_default_tags({"gpu_type": gpu_type})

    def record_forward(self, figures: ForwardFigures) -> None:
        self._size.observe(float(figures.requests))
        self._step.observe(figures.seconds)

    def record_wait(self, seconds: float) -> None:
        self._wait.observe(seconds)


class WorkGauges:
    """A Denoiser replica's queue as the router and the autoscaler see it, by GPU type: requests held
    and their predicted work-seconds at its own step times (the Grafana dashboard's "Queue per GPU
    type"). Set whenever Serve polls the replica's routing or autoscaling stats."""

    def __init__(self, gpu_type: str):
        tags = ("gpu_type",)
        self._requests = metrics.Gauge("offload_serve_queued_requests", description="Requests this replica holds "
                                       "(its running batch and its queue).", tag_keys=tags)
        self._work = metrics.Gauge("offload_serve_queued_work_seconds", description="Predicted seconds until this "
                                   "replica is idle, at its measured seconds per step (absent: nothing measured).",
                                   tag_keys=tags)
        for gauge in (self._requests, self._work):
            gauge.set_default_tags({"gpu_type": gpu_type})

    def record(self, requests: int, work_s: float | None) -> None:
        self._requests.set(float(requests))
        if work_s is not None:
            self._work.set(work_s)


# Host tiers as the residency report totals them (offload_core.residency.report), by the tier's name.
HOST_TIERS = (("pinned", "host_pinned_bytes"), ("pageable", "host_pageable_bytes"), ("mapped", "host_mapped_bytes"),
              ("shared", "host_shared_bytes"))


class ReplicaGauges:
    """Where a replica's weights are and what it leased, set each time it publishes its residency report:
    host bytes by tier, its device leases and its share against the capacity of its GPU (the Grafana
    dashboard's "Host bytes by tier" and "Device leases against capacity per GPU")."""

    def __init__(self, stage: str, gpu: str):
        self._host = metrics.Gauge("offload_serve_host_bytes", description="Weight bytes this replica holds in "
                                   "host memory, by tier (pinned includes staging; shared: the node weight store).",
                                   tag_keys=("stage", "tier"))
        self._leased = metrics.Gauge("offload_serve_device_leased_bytes", description="Device bytes this replica "
                                     "leased from its node's ledger (standing + call reservation).",
                                     tag_keys=("stage", "gpu"))
        self._share = metrics.Gauge("offload_serve_device_share_bytes", description="This replica's share of its "
                                    "GPU (num_gpus of the pool): what it plans against.", tag_keys=("stage", "gpu"))
        self._capacity = metrics.Gauge("offload_serve_gpu_capacity_bytes", description="What the node ledger may "
                                       "lease on this GPU, all replicas together.", tag_keys=("gpu",))
        for gauge in (self._host, self._leased, self._share):
            gauge.set_default_tags({"stage": stage})
        self._gpu = gpu

    def record(self, weights_totals: dict, standing_bytes: int, reserved_bytes: int, share_bytes: int,
               capacity_bytes: int) -> None:
        for tier, field in HOST_TIERS:
            self._host.set(float(weights_totals.get(field, 0)), tags={"tier": tier})
        self._leased.set(float(standing_bytes + reserved_bytes), tags={"gpu": self._gpu})
        self._share.set(float(share_bytes), tags={"gpu": self._gpu})
        self._capacity.set(float(capacity_bytes), tags={"gpu": self._gpu})


class PendingGauge:
    """Stage replicas Ray has not placed, per deployment (set by the ingress as it watches the app).
    Ray's own Gauge: Serve's reserves the ``deployment`` tag for the replica that records."""

    def __init__(self):
        self._pending = ray_metrics.Gauge("offload_serve_pending_replicas", description="Replicas of the deployment "
                                      "waiting for a node, or placed and still starting after 30 s (GET "
                                      "/v1/residency -> pending says why).",
                                      tag_keys=("deployment",))

    def record(self, counts: dict[str, int]) -> None:
        for deployment, count in counts.items():
            self._pending.set(float(count), tags={"deployment": deployment})
