"""On a real GPU: staged copies, and slots that stay valid whichever stream is current when they are freed.

Runs only where CUDA is (``bench/gpu_check.sh`` runs every ``-k cuda`` test of tests/offload_core at
its end). Imports torch, diffusers and the engine only: a GPU machine needs no Ray for it.
"""
from __future__ import annotations

import time

import pytest
import torch

from offload_core.host.tier import HostingTier
from offload_core.layout import declared_layer_groups, resolve_layer_group
from offload_core.streaming.engine import StreamingConfig, apply_layer_streaming
from tests.offload_core.tiny_models import FLUX, WAN

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="CUDA streams, page-locked staging and the caching allocator need a GPU")

# ~50 ms of GPU time at 1-2 GHz: keeps a stream's kernels queued while the host frees and reallocates.
SLEEP_CYCLES = 100_000_000


def _tiers(model, tier: HostingTier) -> dict[str, HostingTier]:
    return {f"{g}.{i}": tier for g in declared_layer_groups(model)
            for i in range(len(resolve_layer_group(model, g).layers))}


def _cuda_inputs(case) -> dict:
    return {k: (v.cuda() if isinstance(v, torch.Tensor) else v) for k, v in case.inputs().items()}


def _expected(case, inputs) -> torch.Tensor:
    with torch.no_grad():
        return case.run(case.build().cuda(), inputs)


def _scribble_over_freed_blocks(nbytes: int, stream) -> list[torch.Tensor]:
    """Allocate same-size blocks on ``stream`` and fill them: a freed slot not yet safe would be handed out."""
    with torch.cuda.stream(stream):
        return [torch.full((nbytes,), 255, dtype=torch.uint8, device="cuda") for _ in range(8)]


def _one_request_on_three_streams(case, model, streamer, inputs) -> tuple[torch.Tensor, list]:
    prepare, forward, finish = torch.cuda.Stream(), torch.cuda.Stream(), torch.cuda.Stream()
    with torch.cuda.stream(prepare):
        streamer.prepare_for_use()
    with torch.cuda.stream(forward), torch.no_grad():
        forward.wait_stream(torch.cuda.current_stream())
        torch.cuda._sleep(SLEEP_CYCLES)  # the forward's kernels wait behind this
        out = case.run(model, inputs)
    with torch.cuda.stream(finish):
        streamer.finish_use()  # frees slots and resident buffers while the forward is still queued
    junk = _scribble_over_freed_blocks(streamer.ring.regions.nbytes, prepare)
    torch.cuda.synchronize()
    return out, junk


@pytest.mark.parametrize("tier", list(HostingTier), ids=lambda t: t.value)
@pytest.mark.parametrize("depth,resident", [(1, 0), (2, 1)])
@pytest.mark.parametrize("case", [WAN, FLUX], ids=lambda c: c.name)
def test_cuda_prepare_forward_and_finish_on_different_streams_stay_bitwise_equal(case, depth, resident, tier):
    inputs = _cuda_inputs(case)
    expected = _expected(case, inputs)
    model = case.build()
    streamer = apply_layer_streaming(model, "cuda", StreamingConfig(prefetch_depth=depth, resident=resident,
                                                                    hosting=_tiers(model, tier)))
    try:
        for _ in range(3):
            out, _ = _one_request_on_three_streams(case, model, streamer, inputs)
            assert torch.equal(out, expected)
        assert streamer.meter.peak_bytes == streamer.predicted_peak_bytes()
    finally:
        streamer.remove()


def test_cuda_freeing_slots_without_retiring_them_lets_the_allocator_hand_them_out_under_running_kernels(
        monkeypatch):
    """The negative control: the test above can fail. Without record_stream the scribble lands in the slots."""
    inputs = _cuda_inputs(WAN)
    expected = _expected(WAN, inputs)
    model = WAN.build()
    streamer = apply_layer_streaming(model, "cuda", StreamingConfig(hosting=_tiers(model, HostingTier.PINNED)))
    monkeypatch.setattr(streamer.device, "retire", lambda buffers: None)
    try:
        outs = [_one_request_on_three_streams(WAN, model, streamer, inputs)[0] for _ in range(3)]
        assert not all(torch.equal(out, expected) for out in outs)
    finally:
        streamer.remove()


@pytest.mark.parametrize("tier", [HostingTier.PAGEABLE, HostingTier.MAPPED], ids=lambda t: t.value)
def test_cuda_staged_layers_copy_through_page_locked_buffers_filled_by_a_copier_thread(tier):
    inputs = _cuda_inputs(WAN)
    expected = _expected(WAN, inputs)
    model = WAN.build()
    streamer = apply_layer_streaming(model, "cuda", StreamingConfig(hosting=_tiers(model, tier)))
    try:
        staging = streamer.staging
        assert staging is not None and all(t.is_pinned() for t in staging.host_tensors())
        assert sum(t.numel() for t in staging.host_tensors()) == streamer.staging_bytes
        with torch.no_grad():
            for _ in range(3):
                assert torch.equal(WAN.run(model, inputs), expected)
        assert staging.fills >= 3 * len(streamer.layers) and staging.restarts == 0
    finally:
        streamer.remove()


def test_cuda_a_host_wait_on_a_copy_event_sleeps_instead_of_spinning():
    from offload_core.streaming.device import get_device

    device = get_device("cuda")
    with device.on_copy_stream():
        torch.cuda._sleep(SLEEP_CYCLES)  # ~50 ms queued on the copy stream
    event = device.record_copy()
    wall, cpu = time.perf_counter(), time.thread_time()
    device.host_waits(event)
    wall, cpu = time.perf_counter() - wall, time.thread_time() - cpu
    # A spinning cudaEventSynchronize burns the whole wait on this thread's CPU clock.
    assert wall > 0.01 and cpu < 0.5 * wall, f"waited {wall:.3f} s using {cpu:.3f} s of CPU"


@pytest.mark.parametrize("widen_mode", ["eager", "fused"])
@pytest.mark.parametrize("tier", [HostingTier.PINNED, HostingTier.PAGEABLE], ids=lambda t: t.value)
@pytest.mark.parametrize("depth", [1, 2])
def test_cuda_fp8_widens_on_their_own_stream_stay_bitwise_when_each_widen_is_slow(depth, tier, widen_mode):
    """Each widen held ~5 ms on the widen stream: a copy into its landing buffer or its slot, or a
    layer's compute, that did not wait for it would read or overwrite bytes it is still writing.
    Fused: the compiled widen (one Triton kernel per group) is bitwise the eager one's reference too."""
    from offload_core.fp8_widen import WidenMode
    from offload_core.quant import WeightFormat, fake_quantize_

    inputs = _cuda_inputs(WAN)
    reference = WAN.build()
    model = WAN.build()
    model.load_state_dict(reference.state_dict())
    fake_quantize_(reference.blocks)
    with torch.no_grad():
        expected = WAN.run(reference.cuda(), inputs)
    streamer = apply_layer_streaming(model, "cuda", StreamingConfig(
        prefetch_depth=depth, weights=WeightFormat.FP8, hosting=_tiers(model, tier), widen=WidenMode(widen_mode)))
    try:
        for layer in streamer.layers:
            original = layer.host.widen

            def slow(regions, how, original=original):
                torch.cuda._sleep(SLEEP_CYCLES // 10)
                original(regions, how)
            layer.host.widen = slow
        for _ in range(3):
            streamer.prepare_for_use()
            with torch.no_grad():
                assert torch.equal(WAN.run(model, inputs), expected)
            streamer.finish_use()
        assert streamer.meter.peak_bytes == streamer.predicted_peak_bytes()
    finally:
        streamer.remove()
