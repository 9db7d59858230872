"""Request-shape buckets, and the block-call rules that let one compiled graph serve a whole bucket.

A bucket names the request shapes (resolution, frames, batch) one compiled graph per block class
serves. Which dimensions of a block's inputs vary with the shape is not declared by diffusers: it
is learned once, at warm-up, from one eager pass per shape of the bucket (``learn_rules``); every
later call whose inputs fit a rule has exactly those dimensions marked dynamic, in the bucket's
range, before the compiled block sees them, so a second shape in a bucket is not a recompile (dynamo
would otherwise compile the first shape static and recompile at the second). A bucket of one
shape marks nothing: its graph is static, the fastest kernels. Runs in the process that runs the model.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Sequence

import torch

logger = logging.getLogger(__name__)

# dynamo specializes sizes 0 and 1 whatever is marked: a dimension that is 1 at some shape of the
# bucket cannot be a symbol, so it stays static (the bucket then compiles once per value of it).
MIN_DYNAMIC_SIZE = 2


@dataclass(frozen=True, order=True)
class RequestShape:
    """One request shape a stage serves: pixels, frames (1 for an image), requests in one step."""

    height: int
    width: int
    frames: int = 1
    batch: int = 1

    def __str__(self) -> str:
        return f"{self.width}x{self.height}x{self.frames}" + (f"*{self.batch}" if self.batch > 1 else "")


@dataclass(frozen=True)
class ShapeBucket:
    """Request shapes that share one compiled graph per block class (compiled once, at warm-up)."""

    name: str
    shapes: tuple[RequestShape, ...]

    def __post_init__(self):
        if not self.shapes:
            raise ValueError(f"compile bucket {self.name!r} has no shapes")

    def __contains__(self, shape: RequestShape) -> bool:
        return shape in self.shapes


# One block call's inputs, flattened: each leaf's shape, None for a leaf that is not a tensor.
Signature = tuple[tuple[int, ...] | None, ...]


def signature(leaves: Sequence[object]) -> Signature:
    return tuple(tuple(leaf.shape) if isinstance(leaf, torch.Tensor) else None for leaf in leaves)


@dataclass(frozen=True)
class DynamicDim:
    leaf: int  # index in the call's flattened inputs
    dim: int
    low: int
    high: int


@dataclass(frozen=True)
class BucketRule:
    """The block calls of one bucket: every static size as learned, the dynamic ones within range."""

    bucket: str
    base: Signature
    dynamic: tuple[DynamicDim, ...]

    def matches(self, seen: Signature) -> bool:
        if len(seen) != len(self.base):
            return False
        ranged = {(d.leaf, d.dim): d for d in self.dynamic}
        for leaf, (want, got) in enumerate(zip(self.base, seen)):
            if want is None or got is None:
                if want != got:
                    return False
                continue
            if len(want) != len(got):
                return False
            for dim, (w, g) in enumerate(zip(want, got)):
                span = ranged.get((leaf, dim))
                if (span is None and w != g) or (span is not None and not span.low <= g <= span.high):
                    return False
        return True


def learn_rules(bucket: str, runs: Sequence[Sequence[Signature]]) -> tuple[BucketRule, ...]:
    """Rules from one eager pass per shape of ``bucket``: ``runs[i]`` is the distinct signatures one
    block class saw at shape i, in first-seen order (the k-th of each run describe the same call)."""
    rules = []
    for calls in zip(*runs):
        base = calls[0]
        if any(len(c) != len(base) or any((a is None) != (b is None) or (a is not None and len(a) != len(b))
                                          for a, b in zip(c, base)) for c in calls):
            raise ValueError(f"bucket {bucket!r}: a block's inputs change structure between shapes: {calls}")
        dynamic = []
        for leaf, shape in enumerate(base):
            for dim in range(len(shape or ())):
                sizes = [c[leaf][dim] for c in calls]
                if len(set(sizes)) > 1:
                    if min(sizes) < MIN_DYNAMIC_SIZE:
                        logger.info("compile bucket %s: input %d dim %d takes sizes %s, size 1 cannot be dynamic: "
                                    "compiled per size", bucket, leaf, dim, sorted(set(sizes)))
                        continue
                    dynamic.append(DynamicDim(leaf, dim, min(sizes), max(sizes)))
        rules.append(BucketRule(bucket, base, tuple(dynamic)))
    return tuple(rules)


def parse_bucket(text: str) -> ShapeBucket:
    """``"832x480x1,1280x720"``: shapes ``WxH`` or ``WxHxF`` (frames 1 when left out) that share a bucket."""
    shapes = []
    for part in text.split(","):
        fields = part.strip().lower().split("x")
        if len(fields) not in (2, 3) or not all(f.isdigit() and int(f) > 0 for f in fields):
            raise ValueError(f"compile bucket {text!r}: {part.strip()!r} is not WxH or WxHxF (positive integers)")
        width, height, frames = (*map(int, fields), 1)[:3]
        shapes.append(RequestShape(height, width, frames))
    return ShapeBucket(text.replace(" ", ""), tuple(shapes))
