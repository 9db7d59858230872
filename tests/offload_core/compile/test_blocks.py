"""Compiled repeated blocks under streaming: one graph per bucket, hooks outside, bitwise equal to resident.

Compile is slow on the 2-core VM (the tiny Wan block: ~8 s for its first graph), so the module shares
one compiled class (the process-wide kernel registry) and one warmed bucket between its tests; the
module: 39 s with a cold inductor cache (28 s of it the warm-up fixture), 8 s warm.
"""
from __future__ import annotations

import pytest
import torch

from offload_core.compile import (
    CompileConfig,
    CompileMode,
    RequestShape,
    ShapeBucket,
    apply_block_compile,
    warm_buckets,
)
from offload_core.compile.blocks import BlockCompileError, block_classes
from offload_core.fp8_widen import WidenMode
from offload_core.host.tier import HostingTier
from offload_core.layout import declared_layer_groups, resolve_layer_group
from offload_core.quant import WeightFormat, fake_quantize_
from offload_core.streaming.engine import StreamingConfig, apply_layer_streaming
from tests.offload_core.tiny_models import WAN

BUCKET = ShapeBucket("small", (RequestShape(64, 64), RequestShape(64, 128), RequestShape(128, 128)))
SERVED = (RequestShape(64, 128), RequestShape(128, 128))  # two shapes of the bucket, as requests


def inputs(shape: RequestShape) -> dict:
    g = torch.Generator().manual_seed(shape.height * 7 + shape.width)
    return {"hidden_states": torch.randn(shape.batch, 4, shape.frames, shape.height // 8, shape.width // 8,
                                         generator=g),
            "timestep": torch.tensor([500] * shape.batch),
            "encoder_hidden_states": torch.randn(shape.batch, 6, 16, generator=g)}


def runner(model, streamer=None):
    def run(shape: RequestShape) -> torch.Tensor:
        with torch.no_grad():
            out = model(**inputs(shape)).sample
        if streamer is not None:
            streamer.finish_use()
        return out
    return run


def layers(model):
    return [m for group in declared_layer_groups(model) for m in resolve_layer_group(model, group).layers]


def tiers(model, tier: HostingTier) -> dict:
    return {f"{g}.{i}": tier for g in declared_layer_groups(model) for i, _ in enumerate(resolve_layer_group(model, g).layers)}


@pytest.fixture(scope="module")
def warmed():
    """A streamed tiny Wan (pinned, 2 slots for 4 layers) whose bucket was compiled by the warm-up."""
    model = WAN.build()
    streamer = apply_layer_streaming(model, "cpu", StreamingConfig(hosting=tiers(model, HostingTier.PINNED)))
    blocks = apply_block_compile(model, CompileConfig(buckets=(BUCKET,)))
    figures = warm_buckets(blocks, runner(model, streamer))
    yield model, streamer, blocks, figures
    blocks.remove()
    streamer.remove()


def test_a_bucket_compiles_once_and_requests_after_warmup_never_recompile(warmed):
    model, streamer, blocks, (figure,) = warmed
    # One graph for the block class over the bucket's three shapes: the learned rule marks the
    # varying token dimension dynamic before the first compile (dynamo alone compiles the first
    # shape static, then again dynamic at the second: 2 graphs).
    assert (figure.bucket, figure.shapes, figure.graphs) == ("small", 3, 1)
    entered = []
    handle = model.blocks[0].register_forward_pre_hook(lambda *_: entered.append(1))
    before = blocks.graphs_compiled()
    try:
        for _ in range(2):  # 2 requests x 2 shapes; 4 layers through 2 ring slots: each lands in another slot
            for shape in SERVED:
                runner(model, streamer)(shape)
    finally:
        handle.remove()
    assert blocks.graphs_compiled() - before == 0, "a request after warm-up recompiled"
    assert len(entered) == 4, "hooks run eagerly at every call, outside the compiled forward"
    assert streamer.ring.n_slots < len(streamer.layers)


@pytest.mark.parametrize("tier", [HostingTier.PINNED, HostingTier.PAGEABLE, HostingTier.MAPPED], ids=lambda t: t.value)
def test_streamed_compiled_is_bitwise_the_resident_compiled(warmed, tier, remove_after):
    resident = WAN.build()
    remove_after(apply_block_compile(resident, CompileConfig(buckets=(BUCKET,))))
    model = WAN.build()
    streamer = remove_after(apply_layer_streaming(model, "cpu", StreamingConfig(hosting=tiers(model, tier), resident=1)))
    remove_after(apply_block_compile(model, CompileConfig(buckets=(BUCKET,))))
    before = warmed[2].graphs_compiled()
    for shape in SERVED:
        assert torch.equal(runner(model, streamer)(shape), runner(resident)(shape)), shape
    assert warmed[2].graphs_compiled() == before, "resident and streamed layers share the warmed graph"


@pytest.mark.parametrize("tier", [HostingTier.PINNED, HostingTier.PAGEABLE], ids=lambda t: t.value)
def test_streamed_fp8_compiled_is_bitwise_the_fake_quantized_resident_compiled(warmed, tier, remove_after):
    resident = WAN.build()
    fake_quantize_(layers(resident))
    remove_after(apply_block_compile(resident, CompileConfig(buckets=(BUCKET,))))
    model = WAN.build()
    streamer = remove_after(apply_layer_streaming(
        model, "cpu", StreamingConfig(weights=WeightFormat.FP8, hosting=tiers(model, tier))))
    blocks = apply_block_compile(model, CompileConfig(buckets=(BUCKET,)))
    assert streamer.widen_mode is WidenMode.FUSED, "compiled blocks widen in one compiled pass per group too"
    for shape in SERVED:
        assert torch.equal(runner(model, streamer)(shape), runner(resident)(shape)), shape
    # a replica's re-plan streams the compiled model again: its FP8 layers keep the fused widen
    streamer.remove()
    again = apply_layer_streaming(model, "cpu", StreamingConfig(weights=WeightFormat.FP8, hosting=tiers(model, tier)))
    assert again.widen_mode is WidenMode.FUSED
    assert torch.equal(runner(model, again)(SERVED[0]), runner(resident)(SERVED[0]))
    blocks.remove()
    assert again.widen_mode is WidenMode.EAGER, "remove() gives back the config's widen"
    again.remove()


def test_compiled_matches_eager_within_torch_testing_float32_tolerance(warmed):
    model, streamer, _, _ = warmed
    eager = WAN.build()
    for shape in SERVED:
        # torch.testing's float32 defaults (rtol 1.3e-6, atol 1e-5): what inductor's check_model
        # compares with unless a test widens them; inductor reorders and fuses float32 reductions.
        torch.testing.assert_close(runner(model, streamer)(shape), runner(eager)(shape))


def test_streamed_blocks_compile_their_declared_class_and_none_compiles_nothing():
    model = WAN.build()
    assert [c.__name__ for c in block_classes(model)] == ["WanTransformerBlock"]
    assert apply_block_compile(model, CompileConfig(mode=CompileMode.NONE)) is None
    assert "forward" not in vars(model.blocks[0])
    blocks = apply_block_compile(model, CompileConfig())
    try:
        with pytest.raises(BlockCompileError, match="already compiled"):
            apply_block_compile(model, CompileConfig())
        assert blocks.summary().blocks == 4 and blocks.summary().classes == ("WanTransformerBlock",)
    finally:
        blocks.remove()
    assert "forward" not in vars(model.blocks[0])


def test_cuda_graph_modes_are_refused_since_streamed_weights_move():
    with pytest.raises(ValueError, match="CUDA graphs"):
        CompileConfig(mode_name="reduce-overhead")


def test_compiled_forward_keeps_the_block_signature_and_refuses_a_wrapped_block():
    import inspect

    model = WAN.build()
    blocks = apply_block_compile(model, CompileConfig())
    try:
        assert "rotary_emb" in inspect.signature(model.blocks[0].forward).parameters  # a step cache reads it
    finally:
        blocks.remove()
    model.blocks[1].forward = lambda *a, **k: None
    with pytest.raises(BlockCompileError, match="already have their forward wrapped"):
        apply_block_compile(model, CompileConfig())
