"""Predicted finish times and work-seconds on one replica, from its :class:`ReplicaLoad`.

Pure arithmetic, run wherever the loads are read: the request router in the ingress's process
(:mod:`deployments.routing`), the autoscaling policy in Serve's controller, the mixed-fleet bench.

The model replays the replica's step batcher (:mod:`deployments.replica.batching`): FIFO; the
queue's head joins the running batch at a step boundary when its shape matches and there is room
(``max_batch``); an incompatible head waits for the batch to drain. Each step of a batch of ``b``
requests at a shape costs the replica's measured seconds per step there (:func:`step_seconds`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Sequence

from deployments.capacity.replica_load import QueuedWork, ReplicaLoad, Shape, StepTiming

# The extra cost of each request a step's batch adds, as a fraction of one request's step, where a
# replica has measured one batch size only. On the GPUs this service is for the weights' stream
# bounds a step (FLUX.1-dev: ~1 s of PCIe per forward) and a second request adds its compute only:
# ~0.25 of a streamed step (bench/batching.py's tiny-zoo figures put a batch of 4 at ~1.7x one).
DEFAULT_JOIN_COST = 0.25


@dataclass(frozen=True)
class Prediction:
    """A new request's predicted finish on one replica, and what the estimate stood on."""

    finish_s: float  # from the stats' time to the request's last step
    joins_running: bool  # it joins the batch running now (a step boundary away), not a new one
    own_step_s: float  # its first step's predicted seconds there


def join_cost(load: ReplicaLoad, shape: Shape) -> float:
    """The fraction of a step each extra request adds, fitted from the two smallest measured batch
    sizes at ``shape`` (t(b) = t(1) (1 + j (b - 1))), else DEFAULT_JOIN_COST; within [0, 1]."""
    sizes = sorted((t for t in load.step_s if t.shape == shape), key=lambda t: t.batch)
    if len(sizes) < 2:
        return DEFAULT_JOIN_COST
    a, b = sizes[0], sizes[1]
    ratio = b.seconds / a.seconds
    denominator = (b.batch - 1) - ratio * (a.batch - 1)
    if denominator <= 0:
        return DEFAULT_JOIN_COST
    return min(1.0, max(0.0, (ratio - 1.0) / denominator))


def step_seconds(load: ReplicaLoad, shape: Shape, batch: int) -> float | None:
    """Seconds of one step of ``batch`` requests at ``shape`` on this replica; None: nothing measured.

    Measured (shape, batch) as is; another batch size of the shape through :func:`join_cost`; an
    unmeasured shape from the measured one nearest in pixel-frames, scaled by their ratio.
    """
    exact = load.timing(shape, batch)
    if exact is not None:
        return exact.seconds
    same = [t for t in load.step_s if t.shape == shape]
    if same:
        base = min(same, key=lambda t: abs(t.batch - batch))
        j = join_cost(load, shape)
        return base.seconds * (1 + j * (batch - 1)) / (1 + j * (base.batch - 1))
    if not load.step_s:
        return None
    nearest = min(load.step_s, key=lambda t: (abs(t.shape.pixel_frames - shape.pixel_frames), t.batch))
    scaled = replace(nearest, shape=shape, seconds=nearest.seconds * shape.pixel_frames / nearest.shape.pixel_frames)
    return step_seconds(replace(load, step_s=(scaled,)), shape, batch)


def _replay(load: ReplicaLoad, later: Sequence[tuple[float, QueuedWork]] = (),
            track: int | None = None) -> tuple[float, float | None, bool] | None:
    """Run the batcher's admission from the stats' time over running + waiting, then ``later``: work
    arriving ``offset`` seconds after the stats were taken (ascending), which can join only at a step
    boundary after it arrived. Returns (seconds until idle, the finish of ``later[track]``, whether it
    joined the batch running at the start), or None when a step cannot be priced."""
    running = [[w.shape, w.steps, None] for w in load.running]
    queue = [[0.0, w.shape, w.steps, None] for w in load.waiting]
    queue += [[offset, w.shape, w.steps, i] for i, (offset, w) in enumerate(later)]
    first_batch = bool(running)
    clock, finish, joined = 0.0, None, False
    while running or queue:
        if not running and queue[0][0] > clock:  # idle until the next arrival
            clock, first_batch = queue[0][0], False
        while (queue and queue[0][0] <= clock and len(running) < load.max_batch
               and (not running or queue[0][1] == running[0][0])):
            _, shape, steps, index = queue.pop(0)
            joined = joined or (index == track and first_batch)
            running.append([shape, steps, index])
        cost = step_seconds(load, running[0][0], len(running))
        if cost is None:
            return None
        # Run to the next boundary anything changes at: a member finishing (room, maybe a new shape),
        # or the first one after a compatible request arrives (it joins there).
        advance = min(member[1] for member in running)
        head = queue[0] if queue else None
        if head is not None and head[0] > clock and len(running) < load.max_batch and head[1] == running[0][0]:
            advance = min(advance, max(1, math.ceil((head[0] - clock) / cost)))
        clock += advance * cost
        for member in running:
            member[1] -= advance
        for member in [m for m in running if m[1] <= 0]:
            running.remove(member)
            if member[2] is not None and member[2] == track:
                finish = clock
        if not running:
            first_batch = False
    return clock, finish, joined


def predicted_finish_s(load: ReplicaLoad, shape: Shape, steps: int, elapsed_s: float = 0.0,
                       sent: Sequence[tuple[float, QueuedWork]] = ()) -> Prediction | None:
    """When a new request of ``shape`` and ``steps`` would finish on this replica, in seconds from
    now: ``elapsed_s`` after the stats were taken (the replica ran on meanwhile), after ``sent`` (work
    sent there since the stats, at its offsets from them). None: the replica has measured nothing."""
    later = sorted(sent, key=lambda s: s[0]) + [(max(elapsed_s, 0.0), QueuedWork(shape, steps))]
    replayed = _replay(load, later, track=len(later) - 1)
    if replayed is None:
        return None
    _, finish, joined = replayed
    own = step_seconds(load, shape, 1)
    return Prediction(float(finish) - max(elapsed_s, 0.0), joined, float(own))


def work_seconds(load: ReplicaLoad) -> float | None:
    """Seconds of work the replica holds (running batch and queue, batched as its batcher would) at
    the stats' time; 0 when idle, None when it holds work it has measured nothing for."""
    if not load.running and not load.waiting:
        return 0.0
    replayed = _replay(load)
    return None if replayed is None else replayed[0]


def with_peer_timings(load: ReplicaLoad, peers: list[ReplicaLoad]) -> ReplicaLoad:
    """``load`` with the step times of a peer of the same GPU type when it has measured none itself
    (a replica that just started runs at its type's speed, not at an unknown one)."""
    if load.step_s:
        return load
    donors = [p for p in peers if p.gpu_type == load.gpu_type and p.step_s]
    if not donors:
        return load
    best = max(donors, key=lambda p: sum(t.forwards for t in p.step_s))
    return replace(load, step_s=tuple(StepTiming(t.shape, t.batch, t.seconds, 0) for t in best.step_s))
