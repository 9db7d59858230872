"""The warm-up: uses per request, compute per layer, and the order layers first ran in."""
from __future__ import annotations

import gc
import time

import pytest
import torch

from offload_core.planner.measured_compute import profiles_from_warmup
from offload_core.residency.compute_meter import measure_warmup
from tests.offload_core.tiny_models import hunyuan_inputs, tiny_hunyuan

DELAY_S = 0.5  # between preparing a use and its forward (test_the_first_layers_copy_...)
DECLARED_LAST = ("transformer_blocks", "single_transformer_blocks", "context_embedder.refiner_blocks")


def test_the_warmup_profiles_layers_in_the_order_they_ran_with_their_uses():
    model = tiny_hunyuan(DECLARED_LAST)
    inputs = hunyuan_inputs()

    def request():
        for _ in range(3):  # three denoising steps
            model(**inputs)

    figures = measure_warmup({"dit": model}, request)["dit"]
    assert figures.uses == 3
    assert figures.order[:2] == ("context_embedder.refiner_blocks.0", "context_embedder.refiner_blocks.1")
    assert "single_transformer_blocks.1" not in figures.order, "a GELU has no compute to stream behind"
    assert len(figures.layer_s) == len(figures.order) == 7 and all(t > 0 for t in figures.layer_s)
    (profile,) = profiles_from_warmup({"dit": model}, {"dit": figures})
    assert tuple(layer.key for layer in profile.layers) == figures.order
    assert profile.compute_s_per_layer == figures.layer_s and profile.uses_per_request == 3
    assert all(p.device.type == "cpu" and p.numel() > 0 for p in model.parameters())
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules()), "the warm-up leaves no hook"


# A copy that takes this long would dwarf the tiny Wan blocks' compute (well under 5 ms each on CPU).
# Simulated, on a clock the waits advance: a real 50 ms sleep was within reach of scheduling noise,
# as a worker at nice 15 beside Ray's processes was off the CPU 50 and 100 ms inside a layer.
SLOW_COPY_S = 10.0


def test_a_slow_copy_of_a_streamed_layer_is_not_counted_as_its_compute(monkeypatch):
    import torch

    from offload_core.streaming import engine as streaming
    from offload_core.streaming.engine import StreamingConfig, apply_layer_streaming
    from tests.offload_core.streaming.test_engine_async import DeferredCopyDevice
    from tests.offload_core.tiny_models import WAN

    slept = [0.0]  # what the simulated copy waits added to the host clock
    real_clock = time.perf_counter
    monkeypatch.setattr(time, "perf_counter", lambda: real_clock() + slept[0])

    class SlowCopyDevice(DeferredCopyDevice):
        """Copies land only when waited for, and each wait for a copy takes SLOW_COPY_S of the clock."""

        def _run_until(self, position: int) -> None:
            if position > self.ran:
                slept[0] += SLOW_COPY_S
                self.slow_waits += 1
            super()._run_until(position)

    device = SlowCopyDevice()
    device.slow_waits = 0
    monkeypatch.setattr(streaming, "get_device", lambda _device: device)
    model, inputs = WAN.build(), WAN.inputs()
    expected = WAN.run(model, inputs)
    streamer = apply_layer_streaming(model, "cpu", StreamingConfig(prefetch_depth=1))
    # A collection inside a layer would run earlier objects' finalizers, whose copy waits on this
    # device are slow waits charged to whichever layer was running: collect first, then hold it off.
    gc.collect()
    gc.disable()
    try:
        streamer.prepare_for_use()
        before = device.slow_waits
        figures = measure_warmup({"dit": model}, lambda: WAN.run(model, inputs))["dit"]
        slow = device.slow_waits - before
        streamer.finish_use()
    finally:
        gc.enable()
        streamer.remove()
    n_layers = len(streamer.layers)
    assert slow >= n_layers - 1, "the layers' forwards waited for slow copies"
    assert figures.uses == 1 and len(figures.layer_s) == n_layers
    assert all(0 < s < SLOW_COPY_S / 2 for s in figures.layer_s), f"copy waits counted as compute: {figures.layer_s}"
    assert figures.rest_s < SLOW_COPY_S / 2, f"copy waits counted as non-layer compute: {figures.rest_s}"
    assert figures.layer_span_s >= slow * SLOW_COPY_S, "the spans hold the waits the compute leaves out"
    assert torch.equal(WAN.run(model, inputs), expected)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the compute-stream sync is CUDA's (gpu_check.sh runs it)")
def test_on_cuda_the_warmup_sync_does_not_wait_for_work_on_another_stream():
    """A layer's timer syncs the current (compute) stream only: a copy still running on the copy
    stream for a later layer must not be charged to this layer's compute."""
    from offload_core.residency.compute_meter import compute_sync

    a = torch.randn(4096, 4096, device="cuda")
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        for _ in range(400):  # seconds of fp32 matmuls queued on the other stream (~55 TFLOP)
            a = a @ a / 64.0
    compute_sync(torch.device("cuda"))()
    still_running = not side.query()
    side.synchronize()
    assert still_running, "the compute-stream sync waited for the other stream's work"


def _streamed_wan(resident: int = 0):
    from offload_core.streaming.engine import StreamingConfig, apply_layer_streaming
    from tests.offload_core.tiny_models import WAN

    model, inputs = WAN.build(), WAN.inputs()
    streamer = apply_layer_streaming(model, "cpu", StreamingConfig(prefetch_depth=1, resident=resident,
                                                                   keep_resident=resident > 0))
    return model, inputs, streamer


def _steps(streamer, model, inputs, count: int = 2):
    """A warm-up of ``count`` uses of the streamed tiny Wan (the meter keeps the last pass)."""
    from tests.offload_core.tiny_models import WAN

    def run():
        for _ in range(count):
            streamer.prepare_for_use()
            WAN.run(model, inputs)
            streamer.finish_use()
    return run


def test_the_last_pass_is_kept_as_it_ran_with_the_copy_that_fed_each_streamed_layer():

    model, inputs, streamer = _streamed_wan()
    try:
        figures = measure_warmup({"dit": model}, _steps(streamer, model, inputs))["dit"]
        keys = [layer.key for layer in streamer.layers]
        assert streamer.copy_log is None and streamer.ring.copy_log is None, "the warm-up stops logging copies"
    finally:
        streamer.remove()
    recorded = figures.last_pass
    assert [key for key, _, _ in recorded.compute] == keys == list(figures.order)
    ends = 0.0
    for _, start, end in recorded.compute:  # in order, one after another, inside the pass
        assert ends <= start < end <= recorded.pass_s
        ends = end
    copies = {key: (start, end) for key, start, end in recorded.copies}
    assert list(copies) == keys, "every streamed layer's copy, in the order the layers ran"
    for key, start, _ in recorded.compute:
        assert copies[key][1] <= start, f"{key} computed before its copy landed"
    # Copies on CPU are synchronous, inside the hooks: each lies in a layer's hook time (or in the pass
    # before, for the copies issued at its end), never over a layer's compute.
    for key, (a, b) in copies.items():
        assert not any(a < c_end and c_start < b for _, c_start, c_end in recorded.compute), key
    assert sum(b - a for _, a, b in recorded.waits) >= sum(b - a for a, b in copies.values() if a >= 0)


def test_the_first_layers_copy_is_drawn_however_long_before_the_forward_the_use_was_prepared():
    # prepare_for_use issues the first copy; a loaded host may start the forward much later than
    # a tiny model's whole pass (CI at 9c6cdb9 dropped blocks.0 from the copy lane so). The delay is
    # several of this pass's lengths on a quiet host (~0.05 s); under load a pass took 0.32 s, so the
    # test tells the rules apart whenever the pass is shorter than DELAY_S, and never fails falsely.
    from tests.offload_core.tiny_models import WAN

    model, inputs, streamer = _streamed_wan()

    def late_step():
        for _ in range(2):
            streamer.prepare_for_use()
            time.sleep(DELAY_S)
            WAN.run(model, inputs)
            streamer.finish_use()

    try:
        figures = measure_warmup({"dit": model}, late_step)["dit"]
        keys = [layer.key for layer in streamer.layers]
    finally:
        streamer.remove()
    recorded = figures.last_pass
    assert [key for key, _, _ in recorded.copies] == keys
    assert recorded.copies[0][1] <= -DELAY_S, "the first copy is the one this pass's use issued, DELAY_S before"


def test_a_pass_without_streaming_has_no_copy_lane_and_kept_resident_layers_no_copy():
    from tests.offload_core.tiny_models import WAN

    plain, inputs = WAN.build(), WAN.inputs()
    figures = measure_warmup({"dit": plain}, lambda: WAN.run(plain, inputs))["dit"]
    assert figures.last_pass.copies == () and len(figures.last_pass.compute) == len(figures.order)
    model, inputs, streamer = _streamed_wan(resident=1)
    try:
        def step():
            streamer.prepare_for_use()
            WAN.run(model, inputs)
            streamer.finish_use()

        step()  # the resident layer is copied here, and kept
        recorded = measure_warmup({"dit": model}, step)["dit"].last_pass
        streamed = [layer.key for layer in streamer.layers if not layer.resident]
    finally:
        streamer.remove()
    assert len(streamed) == len(recorded.compute) - 1
    assert [key for key, _, _ in recorded.copies] == streamed


@pytest.mark.skipif(not torch.cuda.is_available(), reason="copies on a CUDA copy stream, timed by its events")
def test_on_cuda_each_layer_computes_after_its_copy_landed_on_the_copy_stream():
    from offload_core.streaming.engine import StreamingConfig, apply_layer_streaming
    from tests.offload_core.tiny_models import WAN

    model, inputs = WAN.build(), {k: v.cuda() if torch.is_tensor(v) else v for k, v in WAN.inputs().items()}
    # Hosted PAGEABLE by default: staged through the copier thread, whose fill wait is not the copy's.
    streamer = apply_layer_streaming(model, "cuda", StreamingConfig(prefetch_depth=1))
    try:
        recorded = measure_warmup({"dit": model}, _steps(streamer, model, inputs), device=torch.device("cuda"))["dit"].last_pass
    finally:
        streamer.remove()
    copies = {key: (start, end) for key, start, end in recorded.copies}
    assert list(copies) == [key for key, _, _ in recorded.compute]
    for key, start, _ in recorded.compute:  # the compute stream waited for the copy's event (1 ms: the clocks' join)
        assert copies[key][0] < copies[key][1] <= start + 1e-3, key
