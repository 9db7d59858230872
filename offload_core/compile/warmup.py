"""Compiling a stage's buckets before it serves: one eager pass per shape learns which block inputs
vary, then one compiled pass per shape compiles the graph the bucket's shapes share (the first
compiles it; the others reuse it, or compile the specialization dynamo insists on, e.g. for a dim of
size 1). A request at a shape of the bucket is then no compile: ``tests/offload_core/compile``.

Runs in the process that runs the model (a replica's warm-up, a bench), with the forwards it runs.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable

from offload_core.compile.blocks import CompiledBlocks
from offload_core.compile.buckets import RequestShape, ShapeBucket

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class BucketWarmup:
    """One bucket's warm-up: its compiled passes' seconds (one forward per shape, compile included) and the graphs they compiled."""

    bucket: str
    shapes: int
    compile_s: float
    graphs: int


def warm_buckets(blocks: CompiledBlocks, run: Callable[[RequestShape], object],
                 buckets: tuple[ShapeBucket, ...] | None = None) -> tuple[BucketWarmup, ...]:
    """Compile each bucket (``blocks.config.buckets`` unless given): ``run(shape)`` runs one forward
    of the model at ``shape``, under the grad mode requests use (dynamo guards on it)."""
    buckets = blocks.config.buckets if buckets is None else buckets
    figures = []
    for bucket in buckets:
        with blocks.recording():
            for shape in bucket.shapes:
                blocks.next_run()
                run(shape)
            blocks.learn(bucket.name)
        before, start = blocks.graphs_compiled(), time.perf_counter()
        # Every shape runs compiled once: a shape the first one's dynamic graph does not cover (a dim
        # of size 1, which dynamo specializes; another stride) compiles here, not on a request's path
        # (the tiny Wan's 1-token image compiled 2 graphs on its first request otherwise).
        for shape in bucket.shapes:
            run(shape)
        figure = BucketWarmup(bucket.name, len(bucket.shapes), time.perf_counter() - start,
                              blocks.graphs_compiled() - before)
        logger.info("compile warm-up %s: bucket %s (%s): %d graphs compiled in %.2f s", type(blocks.model).__name__,
                    bucket.name, ", ".join(map(str, bucket.shapes)), figure.graphs, figure.compile_s)
        figures.append(figure)
    blocks.warmed = tuple(dict.fromkeys((*blocks.warmed, *(b.bucket for b in figures))))
    return tuple(figures)
