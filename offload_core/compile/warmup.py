"""Compiling a stage's buckets before it serves: one eager pass per shape learns which block inputs
vary, then one compiled pass at the bucket's first shape compiles the graph every shape of it runs
(a request at another shape of the bucket is then no compile: ``tests/offload_core/compile``).

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
    """One bucket's warm-up: its compiled pass's seconds (one forward at its first shape, compile included) and the graphs it compiled."""

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
        run(bucket.shapes[0])
        figure = BucketWarmup(bucket.name, len(bucket.shapes), time.perf_counter() - start,
                              blocks.graphs_compiled() - before)
        logger.info("compile warm-up %s: bucket %s (%s): %d graphs compiled in %.2f s", type(blocks.model).__name__,
                    bucket.name, ", ".join(map(str, bucket.shapes)), figure.graphs, figure.compile_s)
        figures.append(figure)
    blocks.warmed = tuple(dict.fromkeys((*blocks.warmed, *(b.bucket for b in figures))))
    return tuple(figures)
