"""A Denoiser replica with ``compile: blocks``: compiled before it is ready, no recompile while it serves,
step batching, the step cache and cancellation as without compile (in process: the Denoiser class).

Three tiny-Wan Denoisers, one after the other (replicas of one stage in one process share a ledger
name): eager streamed, compiled streamed, compiled resident. The compiled two share one compiled
block class: the first compiles the bucket, the second finds it in the process (the module: 80 s on
the 2-core VM with a cold inductor cache, 12 s with torch's default cache dir filled by an earlier run).
"""
from __future__ import annotations

import asyncio
import dataclasses
from dataclasses import dataclass

import pytest
import torch

from compat.torch import compiled_graph_count
from deployments.app import StageArgs, stage_configs
from deployments.models.families import read_family_traits
from deployments.models.step_cache import CACHE_ATTRIBUTE
from deployments.replica.stages import Denoiser, TextEncoder
from deployments.wire.spec import GenerationSpec, PipelineStage
from offload_core.compile import CompileMode
from offload_core.planner.search import PerformanceMode
from tests.deployments.conftest import tiny_args
from zoo.tiny import ensure_tiny_wan

SPEC = GenerationSpec("c", "a red fox", None, 16, 16, 5, 3, 5.0, 3, 1)  # the default request's shape
SECOND = dataclasses.replace(SPEC, request_id="d", seed=4)
CACHED = dataclasses.replace(SPEC, request_id="cached", steps=4, cache_threshold=0.5)
LONG = dataclasses.replace(SPEC, request_id="cancel-me", steps=8)
IMAGE = dataclasses.replace(SPEC, request_id="image", num_frames=1)  # the tiny Wan serves images too


@dataclass(frozen=True)
class Served:
    """What one Denoiser did: its report, its outputs, the graphs compiled while it served."""

    report: dict
    pair: tuple[torch.Tensor, ...]  # SPEC and SECOND, concurrent: one step batch of 2
    alone: torch.Tensor  # SPEC alone
    cached: torch.Tensor
    recompiles: int
    bytes_streamed: int
    cache_wraps_compiled: bool
    cancel: tuple | None  # (steps seen, cancelled after, stopped at, free after, next request's shape)


def _denoise(denoiser, encoded, *specs):
    async def one(spec):
        return [item async for item in denoiser.denoise(encoded, spec, progress=False)][-1].value

    async def together():
        return await asyncio.gather(*(one(spec) for spec in specs))  # concurrent: one step batch

    return tuple(asyncio.run(together()))


def _cancel(denoiser, encoded) -> tuple:
    async def after_first_step() -> int:
        first, seen = asyncio.Event(), []

        async def consume():
            async for item in denoiser.denoise(encoded, LONG):
                seen.append(item)
                first.set()

        task = asyncio.ensure_future(consume())
        await first.wait()
        task.cancel()  # what Serve does when the client disconnects
        with pytest.raises(asyncio.CancelledError):
            await task
        while denoiser.worker.busy:
            await asyncio.sleep(0.001)
        return len(seen)

    seen = asyncio.run(after_first_step())
    flag = denoiser.last_cancelled
    free = not denoiser.worker.busy and denoiser.in_flight == {}
    return seen, flag.cancelled_after_step, flag.stopped_at_step, free, _denoise(denoiser, encoded, LONG)[0].shape


def _serve(facts, encoded, mode: PerformanceMode, compile: CompileMode, cancel: bool) -> Served:
    args = tiny_args(denoiser=StageArgs(offload_mode=mode, host_memory_budget="64MiB", compile=compile))
    denoiser = Denoiser.func_or_class(stage_configs(args, facts)[PipelineStage.DENOISE])
    try:
        before = compiled_graph_count()
        pair, alone = _denoise(denoiser, encoded, SPEC, SECOND), _denoise(denoiser, encoded, SPEC)[0]
        streamed = denoiser.worker.residency.bytes_streamed()
        cached = _denoise(denoiser, encoded, CACHED)[0]
        _denoise(denoiser, encoded, IMAGE)  # the default image: in the default bucket, not compiled on demand
        recompiles = compiled_graph_count() - before
        transformer = denoiser.worker.pipe.transformer
        wrapped = transformer.blocks[0].forward.__kwdefaults__["_f"]  # what the step cache's wrapper calls
        wraps = getattr(transformer, CACHE_ATTRIBUTE, None) is not None and getattr(wrapped, "__wrapped__", None) \
            is not None and wrapped.__wrapped__.__func__ is type(transformer.blocks[0]).forward
        return Served(denoiser.worker.report().to_json(), pair, alone, cached, recompiles, streamed, wraps,
                      _cancel(denoiser, encoded) if cancel else None)
    finally:
        denoiser.worker.close()


@pytest.fixture(scope="module")
def served():
    facts = read_family_traits(ensure_tiny_wan())
    encoder = TextEncoder.func_or_class(stage_configs(tiny_args(), facts)[PipelineStage.ENCODE])
    try:
        encoded = asyncio.run(encoder.encode(SPEC))
    finally:
        encoder.thread.close()
        encoder.worker.close()
    return {"eager": _serve(facts, encoded, PerformanceMode.MEMORY, CompileMode.NONE, cancel=False),
            "streamed": _serve(facts, encoded, PerformanceMode.MEMORY, CompileMode.BLOCKS, cancel=True),
            "resident": _serve(facts, encoded, PerformanceMode.SPEED, CompileMode.BLOCKS, cancel=False)}


def test_a_compiled_replica_reports_its_buckets_and_serves_batches_without_recompiling(served):
    report = served["streamed"].report["compile"]
    assert report["components"] == {"transformer": ["WanTransformerBlock"]}
    (bucket,) = report["buckets"]
    # The default video and the default image, each at batch 1 and max_batch: one graph, dynamic in tokens.
    assert bucket["shapes"] == ["16x16x5", "16x16x5*4", "16x16x1", "16x16x1*4"] and bucket["compile_s"] > 0
    assert any(line.startswith("compile: blocks (transformer: WanTransformerBlock)")
               for line in served["streamed"].report["plan"])
    assert served["eager"].report["compile"] == {"mode": "none"}
    # 1 request, a step batch of 2 (4 rows with guidance), a cached one, an image: all inside the warmed bucket.
    assert served["streamed"].recompiles == 0 and served["resident"].recompiles == 0


def test_compiled_output_is_eager_within_tolerance_and_streamed_bitwise_resident(served):
    eager, streamed, resident = served["eager"], served["streamed"], served["resident"]
    assert resident.bytes_streamed == 0 < streamed.bytes_streamed, "one replica streams, the other does not"
    for e, s, r in zip((*eager.pair, eager.alone), (*streamed.pair, streamed.alone), (*resident.pair, resident.alone)):
        assert torch.equal(s, r), "streamed and resident compiled run the same kernels on the same weights"
        torch.testing.assert_close(s, e)  # float32: torch.testing's defaults, as inductor's check_model


def test_the_step_cache_wraps_the_compiled_blocks_and_decides_alike_streamed_and_resident(served):
    assert served["streamed"].cache_wraps_compiled and served["resident"].cache_wraps_compiled
    assert torch.equal(served["streamed"].cached, served["resident"].cached)
    torch.testing.assert_close(served["streamed"].cached, served["eager"].cached)


def test_a_cancelled_compiled_denoise_stops_at_a_step_boundary_and_the_next_request_runs(served):
    seen, cancelled_after, stopped_at, free, shape = served["streamed"].cancel
    assert seen <= cancelled_after and stopped_at is not None and stopped_at < LONG.steps
    assert free and shape == served["streamed"].alone.shape
