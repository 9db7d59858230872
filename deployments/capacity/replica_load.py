"""One Denoiser replica's load as its routing stats carry it: GPU type, plan, queue, measured step times.

Built in the stage replica (:class:`deployments.replica.load_tracker.LoadTracker`, from its step
batcher) and returned by the Denoiser's ``record_routing_stats``; Serve's controller polls it every
``request_routing_stats_period_s`` and hands it to every process holding a handle (the ingress), where
the request router (:mod:`deployments.routing`) and the autoscaling policy read it back with
:meth:`ReplicaLoad.from_stats`. Plain frozen data, torch-free.

Serve wants ``dict[str, float]``, so everything that is not a number travels in the key: one entry per
queued request (``run|<i>|<shape>`` and ``wait|<i>|<shape>`` -> its remaining steps), one per measured
(shape, batch size) (``step_s|<shape>|<batch>`` -> seconds per step, ``step_n|...`` -> forwards
measured), the GPU type and the plan's mode as ``gpu|<type>`` / ``mode|<mode>`` -> 1.0.

Predicting work-seconds (:mod:`deployments.capacity.finish_model`, used by router and autoscaler):
``predicted_finish_s(load, shape, steps)`` replays the replica's batcher (FIFO; a request joins the
running batch at a step boundary when its shape matches and there is room) over the running batch,
the waiting queue and the new request, each step priced at the replica's measured seconds per step
for (shape, batch size): a measured size as is, another size through the batch-cost curve fitted from
two measured sizes (else a stated join cost), an unmeasured shape scaled by its pixel-frames from the
nearest measured one. ``work_seconds(load)`` is the same replay without a new request: seconds until
the replica is idle. Both return None when the replica has measured nothing (the router then falls
back to Serve's default; the autoscaler may borrow a peer's timings of the same GPU type).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

# Bumped when the encoding changes: a router reading another version treats the replica as statless.
STATS_VERSION = 1.0
_SHAPE = re.compile(r"^(\d+)x(\d+)x(\d+)n(\d+)$")


class StatsError(ValueError):
    """A routing-stats dict this module cannot read (another version, a malformed key)."""


@dataclass(frozen=True, order=True)
class Shape:
    """What a step of one request costs depends on: its size, frames and outputs per prompt."""

    width: int
    height: int
    frames: int  # 1 for images
    n: int = 1  # outputs per prompt: rows of the batch

    @property
    def key(self) -> str:
        return f"{self.width}x{self.height}x{self.frames}n{self.n}"

    @property
    def pixel_frames(self) -> int:
        """The size a step's cost grows with (latent tokens are proportional to it)."""
        return self.width * self.height * self.frames * self.n

    @classmethod
    def from_key(cls, key: str) -> "Shape":
        match = _SHAPE.match(key)
        if match is None:
            raise StatsError(f"not a shape key: {key!r} (want WxHxFnN)")
        return cls(*(int(g) for g in match.groups()))

    @classmethod
    def of(cls, spec) -> "Shape":
        """The shape of a :class:`deployments.wire.spec.GenerationSpec` (duck-typed: no wire import here)."""
        return cls(int(spec.width), int(spec.height), int(spec.num_frames), int(spec.n))


@dataclass(frozen=True)
class QueuedWork:
    """One request on a replica: its shape and the steps it still has to run."""

    shape: Shape
    steps: int


@dataclass(frozen=True)
class StepTiming:
    """Measured seconds per step (one forward) at a shape and batch size: a moving average."""

    shape: Shape
    batch: int
    seconds: float
    forwards: int  # how many forwards the average is over


@dataclass(frozen=True)
class PlanSummary:
    """The replica's offload plan, in three numbers and a word (its full plan is in /v1/residency)."""

    mode: str  # offload_core's PerformanceMode value ("speed", "balanced", ...)
    resident_layers: int  # streamed components' layers kept on the device (whole resident components count all)
    streamed_layers: int  # layers copied in every step
    pinned_share: float  # of the streamed layers, the fraction hosted in page-locked memory


@dataclass(frozen=True)
class ReplicaLoad:
    """One replica's load at ``at_s`` (its wall clock), as the router and the autoscaler read it."""

    gpu_type: str  # the fleet profile's accelerator type ("L4", "H100"), else the GPU's name, else "CPU"
    plan: PlanSummary
    max_batch: int
    running: tuple[QueuedWork, ...]  # the running batch (all one shape)
    waiting: tuple[QueuedWork, ...]  # FIFO
    step_s: tuple[StepTiming, ...]
    at_s: float
    # When the running batch last made progress (its last forward ended, or it was first seen running),
    # on the replica's clock; None: nothing running, or a reporter that does not say.
    progress_at_s: float | None = None

    @property
    def running_batch(self) -> int:
        return len(self.running)

    @property
    def queued_steps(self) -> int:
        return sum(w.steps for w in self.running + self.waiting)

    def timing(self, shape: Shape, batch: int) -> StepTiming | None:
        for t in self.step_s:
            if t.shape == shape and t.batch == batch:
                return t
        return None

    def age_s(self, now_s: float) -> float:
        return now_s - self.at_s

    def stalled_s(self) -> float:
        """How long the running batch had gone without a forward when the stats were taken (0: nothing
        running, or no progress time reported)."""
        if not self.running or self.progress_at_s is None:
            return 0.0
        return max(0.0, self.at_s - self.progress_at_s)

    def to_stats(self) -> dict[str, float]:
        stats = {"v": STATS_VERSION, "at_s": float(self.at_s), "max_batch": float(self.max_batch),
                 f"gpu|{self.gpu_type}": 1.0, f"mode|{self.plan.mode}": 1.0,
                 "plan.resident_layers": float(self.plan.resident_layers),
                 "plan.streamed_layers": float(self.plan.streamed_layers),
                 "plan.pinned_share": float(self.plan.pinned_share)}
        if self.progress_at_s is not None:
            stats["progress_at_s"] = float(self.progress_at_s)
        for name, pool in (("run", self.running), ("wait", self.waiting)):
            for i, work in enumerate(pool):
                stats[f"{name}|{i}|{work.shape.key}"] = float(work.steps)
        for t in self.step_s:
            stats[f"step_s|{t.shape.key}|{t.batch}"] = float(t.seconds)
            stats[f"step_n|{t.shape.key}|{t.batch}"] = float(t.forwards)
        return stats

    @classmethod
    def from_stats(cls, stats: dict) -> "ReplicaLoad":
        """Read :meth:`to_stats`'s dict back; raises :class:`StatsError` on anything else."""
        if stats.get("v") != STATS_VERSION:
            raise StatsError(f"routing stats version {stats.get('v')!r}, this reader knows {STATS_VERSION}")
        try:
            gpu = _one(stats, "gpu|")
            mode = _one(stats, "mode|")
            pools: dict[str, list[tuple[int, QueuedWork]]] = {"run": [], "wait": []}
            timings: dict[tuple[Shape, int], list[float]] = {}
            for key, value in stats.items():
                parts = key.split("|")
                if parts[0] in pools:
                    pools[parts[0]].append((int(parts[1]), QueuedWork(Shape.from_key(parts[2]), int(value))))
                elif parts[0] in ("step_s", "step_n"):
                    slot = timings.setdefault((Shape.from_key(parts[1]), int(parts[2])), [0.0, 0.0])
                    slot[parts[0] == "step_n"] = float(value)
            plan = PlanSummary(mode, int(stats["plan.resident_layers"]), int(stats["plan.streamed_layers"]),
                               float(stats["plan.pinned_share"]))
            return cls(gpu, plan, int(stats["max_batch"]),
                       tuple(w for _, w in sorted(pools["run"], key=lambda p: p[0])),
                       tuple(w for _, w in sorted(pools["wait"], key=lambda p: p[0])),
                       tuple(StepTiming(shape, batch, s, int(n)) for (shape, batch), (s, n) in sorted(timings.items())),
                       float(stats["at_s"]),
                       float(stats["progress_at_s"]) if "progress_at_s" in stats else None)
        except (KeyError, IndexError, ValueError, TypeError) as exc:
            if isinstance(exc, StatsError):
                raise
            raise StatsError(f"malformed routing stats: {type(exc).__name__}: {exc}") from exc


def _one(stats: dict, prefix: str) -> str:
    found = [key[len(prefix):] for key in stats if key.startswith(prefix)]
    if len(found) != 1:
        raise StatsError(f"routing stats carry {len(found)} {prefix!r} entries, want one")
    return found[0]
