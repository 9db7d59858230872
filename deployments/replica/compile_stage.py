"""A stage replica's compiled blocks (``compile: blocks``): applied after its warm-up settled the
residency, each bucket compiled before the replica reports ready.

Order, and why: the warm-up times eager layers and may re-apply the residency (streaming removed and
applied again, which keeps the blocks' forwards); compiling after it keeps compile seconds out of the
measured compute the plan is made from. The step cache wraps the blocks at the first cached forward,
after this, so it wraps the compiled forwards. Each bucket runs the stage's own call at its shapes
(the Denoiser: one forward of the shape's batch of requests through its stepper, as step batching
runs them) under the call lease such a call takes. Run by the
stage replica's worker (deployments/replica/worker.py) once, at start.
"""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import ContextManager, Mapping, Protocol

import torch
from torch import nn

from compat.diffusers import repeated_block_names
from deployments.models import activation_features
from deployments.models.steppers import stepper_for
from deployments.replica.warmup import WarmupSettings, WarmupShape
from deployments.wire.spec import GenerationSpec, PipelineStage
from offload_core.compile import BucketWarmup, CompileConfig, CompileMode, RequestShape, ShapeBucket, warm_buckets
from offload_core.compile import apply_block_compile as compile_blocks

logger = logging.getLogger(__name__)


class CompileHost(Protocol):
    """What the compile warm-up reads from the stage's worker and runs its calls through."""

    replica: str
    config: WarmupSettings
    pipe: object
    device: torch.device

    def in_use(self, activation_bytes: int = 0) -> ContextManager[None]: ...

    def activation_bytes(self, spec: GenerationSpec | None, batch: int = 1) -> int: ...


@dataclass(frozen=True)
class StageCompile:
    """What the replica compiled: per component its block classes, and per bucket its compile seconds."""

    components: tuple[tuple[str, tuple[str, ...]], ...]  # (component, compiled block classes)
    buckets: tuple[ShapeBucket, ...]
    figures: tuple[BucketWarmup, ...]  # per component and bucket, in order

    def to_json(self) -> dict:
        return {"mode": CompileMode.BLOCKS.value, "components": {name: list(c) for name, c in self.components},
                "buckets": [{"name": b.name, "shapes": [str(s) for s in b.shapes],
                             "compile_s": round(sum(f.compile_s for f in self.figures if f.bucket == b.name), 3),
                             "graphs": sum(f.graphs for f in self.figures if f.bucket == b.name)}
                            for b in self.buckets]}

    def describe(self) -> str:
        """One line for the plan's explanation."""
        classes = ", ".join(f"{name}: {'/'.join(c)}" for name, c in self.components)
        buckets = ", ".join(f"{b['name']} [{' '.join(b['shapes'])}] {b['compile_s']} s, {b['graphs']} graphs"
                            for b in self.to_json()["buckets"])
        return f"compile: blocks ({classes}); buckets {buckets}"


def stage_buckets(config: CompileConfig, default: WarmupShape, max_batch: int,
                  serves_images: bool = False) -> tuple[ShapeBucket, ...]:
    """The configured buckets; none configured: one bucket of the default request, at batch 1 and the
    stage's max batch (step batching stacks requests: the batch dimension is one of the bucket's
    dims), and, for a video family that also serves images, the default image (1 frame) beside it:
    without it a compiled Wan replica compiled again on its first image request, on the request's
    path (7.7 s on the tiny Wan on CPU, 0.19 s the next image)."""
    if config.buckets:
        return config.buckets
    frames = (default.frames, 1) if serves_images and default.frames > 1 else (default.frames,)
    shapes = tuple(dict.fromkeys(RequestShape(default.height, default.width, f, batch)
                                 for f in frames for batch in (1, max_batch)))
    return (ShapeBucket(",".join(f"{default.width}x{default.height}x{f}" for f in frames), shapes),)


def apply_stage_compile(host: CompileHost, modules: Mapping[str, nn.Module], config: CompileConfig,
                        default: WarmupShape, max_batch: int) -> StageCompile | None:
    """Compile the stage's components that declare repeated blocks and warm each bucket on them (None:
    no component declares any: a text encoder, a VAE)."""
    facts, stage = host.config.facts, host.config.stage
    targets = {name: m for name, m in modules.items() if repeated_block_names(type(m))}
    if not targets:
        logger.info("%s: compile blocks asked, but no component of the %s stage declares repeated blocks: eager",
                    host.replica, stage.value)
        return None
    buckets = stage_buckets(config, default, max_batch, serves_images="image" in facts.modalities)
    config = dataclasses.replace(config, buckets=buckets)

    stepper = stepper_for(host.pipe, facts, host.device) if stage is PipelineStage.DENOISE else None

    def run(shape: RequestShape) -> None:
        spec = WarmupShape(shape.width, shape.height, shape.frames).spec(facts)
        with host.in_use(host.activation_bytes(spec, shape.batch)):
            if stepper is None:
                value = activation_features.stage_input(host.pipe, facts, stage, spec)
                activation_features.run_stage(host.pipe, facts, stage, spec, host.device, value)
                return
            # The Denoiser's blocks see what step batching gives them: ``batch`` requests' rows in one
            # forward, both guidance branches stacked (the pipeline's own loop runs them apart).
            requests = [stepper.start(activation_features.stage_input(host.pipe, facts, stage, spec),
                                      dataclasses.replace(spec, request_id=f"compile-{shape}-{i}"))
                        for i in range(shape.batch)]
            with torch.no_grad():  # as StepBatch runs it: dynamo guards on the grad mode
                stepper.forward(requests)

    components, figures = [], []
    for name, module in targets.items():
        blocks = compile_blocks(module, config)
        components.append((name, blocks.summary().classes))
        figures.extend(warm_buckets(blocks, run))
    compiled = StageCompile(tuple(components), buckets, tuple(figures))
    logger.info("%s: %s", host.replica, compiled.describe())
    return compiled
