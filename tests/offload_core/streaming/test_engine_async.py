"""The copy/compute event protocol, checked on CPU with a device whose copies are really deferred.

On CUDA a copy on the side stream has not happened until the compute stream waits for its event.
This device reproduces that on CPU: every ``copy_`` issued on its copy stream is queued, and runs
only when the compute stream waits for the event recorded after it. A layer that ran before its
wait would compute on a stale slot and break bitwise equality; the negative control shows that.
"""
from __future__ import annotations

import contextlib

import pytest
import torch
from torch.overrides import TorchFunctionMode

from offload_core.streaming import engine as streaming
from offload_core.streaming.device import Device, DeviceFacts
from offload_core.streaming.engine import StreamingConfig, apply_layer_streaming
from tests.offload_core.tiny_models import FLUX, WAN


class _DeferCopies(TorchFunctionMode):
    def __init__(self, queue: list):
        super().__init__()
        self.queue = queue

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") == "copy_":
            self.queue.append((args[0], args[1]))
            return args[0]
        return func(*args, **(kwargs or {}))


class _CopyEvent:
    def __init__(self, copies: list):
        self.copies = copies

    def run(self) -> None:
        for dst, src in self.copies:
            dst.copy_(src)
        self.copies = []


class DeferredCopyDevice(Device):
    """CPU, but copies on the copy stream happen only when the compute stream waits for them."""

    def __init__(self, honour_waits: bool = True):
        super().__init__(torch.device("cpu"), DeviceFacts())
        self.pending: list = []
        self.honour_waits = honour_waits
        self.waits = 0

    @contextlib.contextmanager
    def on_copy_stream(self):
        with _DeferCopies(self.pending):
            yield

    def record_copy(self):
        event, self.pending = _CopyEvent(self.pending), []
        return event

    def compute_waits(self, event) -> None:
        if event is not None and self.honour_waits:
            self.waits += 1
            event.run()


@pytest.fixture
def deferred(monkeypatch):
    def install(device: DeferredCopyDevice) -> DeferredCopyDevice:
        monkeypatch.setattr(streaming, "get_device", lambda _device: device)
        return device
    return install


@pytest.mark.parametrize("depth,resident", [(1, 0), (2, 1), (1, 0.5)])
@pytest.mark.parametrize("case", [WAN, FLUX], ids=lambda c: c.name)
def test_every_layer_waits_for_its_own_copy_before_it_runs(deferred, case, depth, resident):
    device = deferred(DeferredCopyDevice())
    model, inputs = case.build(), case.inputs()
    expected = case.run(model, inputs)
    streamer = apply_layer_streaming(model, "cpu", StreamingConfig(prefetch_depth=depth, resident=resident))
    for _ in range(2):
        streamer.prepare_for_use()
        assert torch.equal(case.run(model, inputs), expected)
        assert torch.equal(case.run(model, inputs), expected)  # a second step starts from the wrap
        streamer.finish_use()
    n_streamed = sum(1 for layer in streamer.layers if not layer.resident)
    # per request: one wait for the resident copies, one per streamed layer entry (2 steps)
    assert device.waits == 2 * (1 + 2 * n_streamed)


def test_a_layer_that_skipped_its_wait_would_compute_on_a_stale_slot(deferred):
    deferred(DeferredCopyDevice(honour_waits=False))
    model, inputs = WAN.build(), WAN.inputs()
    expected = WAN.run(model, inputs)
    apply_layer_streaming(model, "cpu")
    assert not torch.equal(WAN.run(model, inputs), expected), "the deferred device must expose a missing wait"
