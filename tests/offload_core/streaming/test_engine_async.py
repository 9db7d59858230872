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

from offload_core.host.tier import HostingTier
from offload_core.layout import declared_layer_groups, resolve_layer_group
from offload_core.streaming import engine as streaming
from offload_core.streaming.copier import InlineCopier
from offload_core.streaming.device import Device, DeviceCapacity
from offload_core.streaming.engine import StreamingConfig, apply_layer_streaming
from tests.offload_core.tiny_models import FLUX, WAN


class _DeferCopies(TorchFunctionMode):
    def __init__(self, device: DeferredCopyDevice):
        super().__init__()
        self.device = device

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") == "copy_" and self.device.deferring:
            self.device.queue.append((args[0], args[1]))
            return args[0]
        return func(*args, **(kwargs or {}))


class _CopyEvent:
    """A position on the copy stream: waiting for it runs every copy queued up to it, in order."""

    def __init__(self, position: int):
        self.position = position


class DeferredCopyDevice(Device):
    """CPU, but copies on the copy stream happen only when a stream or host thread waits for them.

    Host-copier jobs (staging fills) run at once, like the CPU's, with deferral off: they are host
    memcpys, not copy-stream work; their wait for a staging buffer's last copy out runs that copy.
    """

    def __init__(self, honour_waits: bool = True):
        super().__init__(torch.device("cpu"), DeviceCapacity())
        self.queue: list = []
        self.ran = 0  # copies of the queue executed so far
        self.deferring = True
        self.honour_waits = honour_waits
        self.waits = 0
        self.host_waits_count = 0

    @contextlib.contextmanager
    def on_copy_stream(self):
        with _DeferCopies(self):
            yield

    def record_copy(self):
        return _CopyEvent(len(self.queue))

    def _run_until(self, position: int) -> None:
        deferring, self.deferring = self.deferring, False
        try:
            for dst, src in self.queue[self.ran:position]:
                dst.copy_(src)
            self.ran = max(self.ran, position)
        finally:
            self.deferring = deferring

    def compute_waits(self, event) -> None:
        if event is not None and self.honour_waits:
            self.waits += 1
            self._run_until(event.position)

    def host_waits(self, event) -> None:
        if event is not None:
            self.host_waits_count += 1
            self._run_until(event.position)

    def host_copier(self, name: str, threads: int | None = None):
        device = self

        class _Copier(InlineCopier):
            def submit(self, job):
                deferring, device.deferring = device.deferring, False
                try:
                    return super().submit(job)
                finally:
                    device.deferring = deferring
        return _Copier()


@pytest.fixture
def deferred(monkeypatch):
    def install(device: DeferredCopyDevice) -> DeferredCopyDevice:
        monkeypatch.setattr(streaming, "get_device", lambda _device: device)
        return device
    return install


def _all(model, tier: HostingTier) -> dict[str, HostingTier]:
    return {f"{g}.{i}": tier for g in declared_layer_groups(model) for i in range(len(resolve_layer_group(model, g).layers))}


@pytest.mark.parametrize("tier", list(HostingTier), ids=lambda t: t.value)
@pytest.mark.parametrize("depth,resident", [(1, 0), (2, 1), (1, 0.5)])
@pytest.mark.parametrize("case", [WAN, FLUX], ids=lambda c: c.name)
def test_every_layer_waits_for_its_own_copy_before_it_runs(deferred, case, depth, resident, tier, remove_after):
    device = deferred(DeferredCopyDevice())
    model, inputs = case.build(), case.inputs()
    expected = case.run(model, inputs)
    streamer = remove_after(apply_layer_streaming(model, "cpu", StreamingConfig(prefetch_depth=depth, resident=resident,
                                                                   hosting=_all(model, tier))))
    for _ in range(2):
        streamer.prepare_for_use()
        assert torch.equal(case.run(model, inputs), expected)
        assert torch.equal(case.run(model, inputs), expected)  # a second step starts from the wrap
        streamer.finish_use()
    assert streamer.meter.peak_bytes == streamer.predicted_peak_bytes()
    n_resident = sum(1 for layer in streamer.layers if layer.resident)
    n_streamed = len(streamer.layers) - n_resident
    # per request: each resident layer waits for its own copy once, each streamed entry once (2 steps)
    assert device.waits == 2 * (n_resident + 2 * n_streamed)
    staged = tier is not HostingTier.PINNED
    assert (device.host_waits_count > 0) is staged, "only staged fills wait (on the copier) for a copy out"


def test_a_layer_that_skipped_its_wait_would_compute_on_a_stale_slot(deferred, remove_after):
    deferred(DeferredCopyDevice(honour_waits=False))
    model, inputs = WAN.build(), WAN.inputs()
    expected = WAN.run(model, inputs)
    remove_after(apply_layer_streaming(model, "cpu", StreamingConfig(hosting=_all(model, HostingTier.PINNED))))
    assert not torch.equal(WAN.run(model, inputs), expected), "the deferred device must expose a missing wait"
