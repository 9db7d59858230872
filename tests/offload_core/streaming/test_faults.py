"""The engine under faults: a failed or hung copy costs no slot and no staging buffer, and the
error reaches the caller typed; a BaseException mid-layer leaves the engine usable."""
from __future__ import annotations

import threading

import pytest
import torch

from offload_core.host.tier import HostingTier
from offload_core.streaming.copier import CopyFailed, FillTimeout
from offload_core.streaming.engine import StreamingConfig, apply_layer_streaming
from tests.offload_core.streaming.test_staging import ThreadedCpuDevice, _keys
from tests.offload_core.tiny_models import WAN


class Cancelled(BaseException):
    """What a cancelled call raises (asyncio's CancelledError and KeyboardInterrupt are BaseExceptions)."""


def _tiers(model) -> dict[str, HostingTier]:
    # Pinned and staged layers in turn: faults in both the direct and the staged copy paths.
    return {key: (HostingTier.PAGEABLE, HostingTier.PINNED)[i % 2] for i, key in enumerate(_keys(model))}


def _fail(layer, times: int, error=OSError("EIO reading the mapping")):
    """Make ``layer``'s host copy raise ``times`` times, then work again."""
    copy, left = layer.host.copy_host_bytes, [times]

    def failing(regions, *how):
        if left[0] > 0:
            left[0] -= 1
            raise error
        return copy(regions, *how)
    layer.host.copy_host_bytes = failing
    return left


def _use(streamer, run):
    """One request as the residency runs it: prepare, forward, finish_use whatever happened."""
    streamer.prepare_for_use()
    try:
        return run()
    finally:
        streamer.finish_use()


def _prefetch_depths(streamer, run) -> list[int]:
    """Layers held in the window at each streamed layer's entry (after the engine's pre-hook) during ``run``."""
    seen: list[int] = []
    handles = [layer.module.register_forward_pre_hook(lambda *_: seen.append(len(streamer.ring.materialized())))
               for layer in streamer.layers if not layer.resident]
    try:
        run()
    finally:
        for handle in handles:
            handle.remove()
    return seen


def _assert_whole(streamer) -> None:
    """Between uses: no layer holds a place in the window, no fill given up on holds staging bytes."""
    assert streamer.ring.materialized() == (), "a layer still holds its place after finish_use"
    assert streamer.staging.buffers_out == 0, "staging bytes are still held by a fill given up on"


@pytest.mark.parametrize("errors", [1, 3])
@pytest.mark.parametrize("keep", [False, True], ids=["released", "kept"])
def test_after_injected_copy_errors_the_next_request_has_the_whole_ring_and_is_bitwise_equal(keep, errors, remove_after):
    model, inputs = WAN.build(), WAN.inputs()
    expected = WAN.run(model, inputs)
    streamer = remove_after(apply_layer_streaming(model, ThreadedCpuDevice(), StreamingConfig(
        resident=1, hosting=_tiers(model), keep_resident=keep)))
    clean = _prefetch_depths(streamer, lambda: _use(streamer, lambda: WAN.run(model, inputs)))
    staged = [layer for layer in streamer.layers if layer.tier is HostingTier.PAGEABLE and not layer.resident]
    left = _fail(staged[0], errors)
    failures = 0
    for _ in range(errors + 1):  # every error spent, the last request has nothing injected left
        try:
            assert torch.equal(_use(streamer, lambda: WAN.run(model, inputs)), expected)
        except CopyFailed as error:
            assert isinstance(error.__cause__, OSError) and "EIO" in str(error)
            failures += 1
        _assert_whole(streamer)
    # A failed prefetch is retried at the layer's entry (the request goes on), a failed fill made
    # ahead for a later use is dropped (logged); an error at the entry reaches the caller, typed.
    # Each injected error is one of these, none is lost.
    dropped = streamer.staging.dropped_failures
    assert left[0] == 0 and failures + streamer.ring.failed_prefetches + dropped == errors
    outputs = []
    depths = _prefetch_depths(streamer, lambda: outputs.append(_use(streamer, lambda: WAN.run(model, inputs))))
    assert torch.equal(outputs[0], expected)
    assert depths and depths == clean, f"prefetch ran short: {depths}, without faults {clean}"
    _assert_whole(streamer)


def test_a_failed_resident_copy_is_typed_and_the_next_use_arms_again(remove_after):
    model, inputs = WAN.build(), WAN.inputs()
    expected = WAN.run(model, inputs)
    streamer = remove_after(apply_layer_streaming(model, ThreadedCpuDevice(), StreamingConfig(
        resident=2, hosting=_tiers(model))))
    for layer in streamer.layers[:2]:
        _fail(layer, 1)
    with pytest.raises(CopyFailed, match="EIO"):
        _use(streamer, lambda: WAN.run(model, inputs))
    with pytest.raises(CopyFailed, match="EIO"):  # the second resident layer's one error
        _use(streamer, lambda: WAN.run(model, inputs))
    assert torch.equal(_use(streamer, lambda: WAN.run(model, inputs)), expected)
    _assert_whole(streamer)
    assert streamer.meter.peak_bytes == streamer.predicted_peak_bytes()


def test_a_failed_fill_made_ahead_for_the_next_use_does_not_stop_finish_use(remove_after):
    model, inputs = WAN.build(), WAN.inputs()
    expected = WAN.run(model, inputs)
    streamer = remove_after(apply_layer_streaming(model, ThreadedCpuDevice(), StreamingConfig(keep_resident=True)))
    assert torch.equal(_use(streamer, lambda: WAN.run(model, inputs)), expected)
    # finish_use filled the next use's first layers ahead; make the next fills fail, then drop them.
    _fail(streamer.layers[0], 1)
    streamer.staging.stop()  # dropped ahead: logged, buffers back, nothing raised here
    _assert_whole(streamer)
    streamer.staging.begin()
    streamer.finish_use()
    _assert_whole(streamer)
    assert torch.equal(_use(streamer, lambda: WAN.run(model, inputs)), expected)


def test_a_hung_fill_times_out_typed_and_the_replica_stays_usable_while_it_hangs(remove_after):
    model, inputs = WAN.build(), WAN.inputs()
    expected = WAN.run(model, inputs)
    streamer = remove_after(apply_layer_streaming(model, ThreadedCpuDevice(), StreamingConfig(fill_timeout_s=0.3)))
    hung, release = streamer.layers[2], threading.Event()
    copy = hung.host.copy_host_bytes
    calls = []

    def hangs_once(regions, *how):
        calls.append(1)
        if len(calls) == 1:
            release.wait(timeout=60)
        return copy(regions, *how)
    hung.host.copy_host_bytes = hangs_once
    try:
        with pytest.raises(FillTimeout, match="blocks.2.*fill_timeout_s"):
            _use(streamer, lambda: WAN.run(model, inputs))
        assert streamer.staging.buffers_out == 1, "the hung fill's buffer is set aside, not reused"
        # Still hung: the next request stages through the other buffer, on a new copier thread.
        assert torch.equal(_use(streamer, lambda: WAN.run(model, inputs)), expected)
    finally:
        release.set()
    streamer.staging._settle_late(5.0)
    assert torch.equal(_use(streamer, lambda: WAN.run(model, inputs)), expected)
    _assert_whole(streamer)


@pytest.mark.parametrize("finish", [True, False], ids=["finish_use", "thread_ended"])
def test_a_base_exception_mid_layer_leaves_the_engine_usable_from_another_thread(finish, remove_after):
    model, inputs = WAN.build(), WAN.inputs()
    expected = WAN.run(model, inputs)
    streamer = remove_after(apply_layer_streaming(model, ThreadedCpuDevice(), StreamingConfig(hosting=_tiers(model))))
    block = streamer.layers[1].module
    forward = block.forward

    def cancelled(*args, **kwargs):
        block.forward = forward
        raise Cancelled()
    block.forward = cancelled
    outcome, done = [], threading.Event()

    def first_call():
        try:
            if finish:
                _use(streamer, lambda: WAN.run(model, inputs))
            else:
                WAN.run(model, inputs)
        except Cancelled:
            outcome.append("cancelled")
        if finish:
            done.wait(timeout=60)  # alive while the next call runs: only finish_use ended its claim
    thread = threading.Thread(target=first_call)
    thread.start()
    try:
        while not outcome and thread.is_alive():
            thread.join(timeout=0.01)
        assert outcome == ["cancelled"]
        # The next call, from this (another) thread: no ConcurrentForwardError, the whole ring.
        assert torch.equal(_use(streamer, lambda: WAN.run(model, inputs)), expected)
    finally:
        done.set()
        thread.join()
    _assert_whole(streamer)
