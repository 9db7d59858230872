"""Pinned host buffers: whole pages of their own, refusals fall back, unlock waits for the device."""
from __future__ import annotations

import logging
import threading

import pytest
import torch

from offload_core.host import pinned
from offload_core.host.pinned import PAGE_BYTES, PinError, allocate_host_buffer, free_host_buffer
from offload_core.host.tier import HostingTier
from offload_core.streaming.engine import StreamingConfig, apply_layer_streaming
from tests.offload_core.tiny_models import Stack

CPU = torch.device("cpu")
CUDA_ERROR_MEMORY_ALLOCATION = 2
CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED = 712


class FakeLocker:
    """Stands in for cudaHostRegister on CPU: refuses the registrations numbered in ``refuse``."""

    def __init__(self, refuse=(), unlock_error: int = 0):
        self.refuse = set(refuse)
        self.unlock_error = unlock_error
        self.calls: list[tuple] = []
        self.locked: dict[int, int] = {}
        self.attempts = 0

    def register(self, ptr: int, nbytes: int, flags: int = 0) -> int:
        self.attempts += 1
        self.calls.append(("register", ptr, nbytes) if flags == 0 else ("register", ptr, nbytes, flags))
        if self.attempts in self.refuse:
            return CUDA_ERROR_MEMORY_ALLOCATION
        self.locked[ptr] = nbytes
        return 0

    def unregister(self, ptr: int) -> int:
        self.calls.append(("unregister", ptr))
        if self.unlock_error:
            return self.unlock_error
        del self.locked[ptr]
        return 0

    def quiesce(self) -> None:
        self.calls.append(("quiesce",))

    def describe(self, code: int) -> str:
        return {CUDA_ERROR_MEMORY_ALLOCATION: "out of memory"}.get(code, "error")


@pytest.fixture
def locker(monkeypatch):
    """Install a fake page locker for the CPU device; returns a function that sets it up."""
    def install(**kwargs) -> FakeLocker:
        fake = FakeLocker(**kwargs)
        monkeypatch.setattr(pinned, "page_locker", lambda device: fake)
        return fake
    return install


def test_small_buffers_are_page_aligned_whole_pages_that_share_no_page():
    a, b = (allocate_host_buffer(2048, pin=False, device=CPU) for _ in range(2))
    for buffer in (a, b):
        assert buffer.data.numel() == 2048 and buffer.mapped_bytes == PAGE_BYTES
        assert buffer.data.data_ptr() % PAGE_BYTES == 0
    assert abs(a.data.data_ptr() - b.data.data_ptr()) >= PAGE_BYTES, "two buffers on one page"


def test_a_pinned_buffer_registers_its_whole_pages_only(locker):
    fake = locker()
    buffer = allocate_host_buffer(PAGE_BYTES + 1, pin=True, device=CPU)
    assert buffer.page_locked and buffer.refusal is None
    assert fake.calls == [("register", buffer.data.data_ptr(), 2 * PAGE_BYTES)]
    free_host_buffer(buffer)
    assert fake.locked == {}


def test_a_refused_pin_stays_pageable_and_says_why(locker):
    fake = locker(refuse={1})
    buffer = allocate_host_buffer(4096, pin=True, device=CPU)
    assert not buffer.page_locked
    assert buffer.refusal.code == CUDA_ERROR_MEMORY_ALLOCATION and "out of memory" in buffer.refusal.explain()
    assert [c[0] for c in fake.calls] == ["register"]
    free_host_buffer(buffer)  # nothing locked: nothing to unlock
    assert ("unregister", buffer.data.data_ptr()) not in fake.calls


def test_memory_is_unlocked_only_after_the_device_is_quiet(locker):
    fake = locker()
    buffer = allocate_host_buffer(100, pin=True, device=CPU)
    free_host_buffer(buffer)
    assert [c[0] for c in fake.calls] == ["register", "quiesce", "unregister"]


def test_a_failed_unlock_raises_pin_error(locker):
    locker(unlock_error=1)
    buffer = allocate_host_buffer(100, pin=True, device=CPU)
    with pytest.raises(PinError, match="unlocking 4096 B failed with CUDA error 1"):
        free_host_buffer(buffer)


def test_a_layer_whose_pin_is_refused_is_streamed_pageable_through_staging_with_one_info_line(locker, caplog):
    fake = locker(refuse={3})  # Stack's layers hold one fp32 buffer each: the third layer is refused
    torch.manual_seed(0)
    model, x = Stack(), torch.randn(3, 8)
    with torch.no_grad():
        expected = model(x)
    with caplog.at_level(logging.INFO, logger="offload_core.streaming.host_layer"):
        streamer = apply_layer_streaming(model, "cpu", StreamingConfig(
            hosting={f"blocks.{i}": HostingTier.PINNED for i in range(4)}))
    tiers = {layer.key: layer.tier for layer in streamer.layers}
    refused = [key for key, tier in tiers.items() if tier is HostingTier.PAGEABLE]
    assert len(refused) == 1 and sum(t is HostingTier.PINNED for t in tiers.values()) == 3
    lines = [r.getMessage() for r in caplog.records if "planned PINNED" in r.getMessage()]
    assert len(lines) == 1 and refused[0] in lines[0] and "CUDA error 2" in lines[0]
    fallen = next(layer for layer in streamer.layers if layer.key == refused[0])
    assert streamer.staging is not None and streamer.staging.stages(fallen), "a PAGEABLE layer goes through staging"
    assert not any(streamer.staging.stages(layer) for layer in streamer.layers if layer is not fallen)
    with torch.no_grad():
        assert torch.equal(model(x), expected)
    streamer.remove()
    assert fake.locked == {}, "every lock taken is given back on remove"


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="page-locking needs a CUDA device")


@needs_cuda
@pytest.mark.parametrize("thread", ["caller", "other"])
def test_cuda_a_real_refusal_leaves_no_error_state_and_kernels_keep_launching(thread):
    device = torch.device("cuda", torch.cuda.current_device())
    torch.ones(1, device=device)
    buffer = allocate_host_buffer(3 * PAGE_BYTES, pin=True, device=device)
    assert buffer.page_locked and buffer.data.is_pinned() and buffer.data.data_ptr() % PAGE_BYTES == 0
    locker = pinned.page_locker(device)
    codes = []

    def refuse_then_launch():
        # Registering the same pages again is a refusal the driver really makes.
        codes.append(locker.register(buffer.data.data_ptr(), buffer.mapped_bytes))
        x = torch.randn(64, 64, device=device)
        # torch checks the runtime's last error after each launch: a refusal left there would raise.
        codes.append(torch.equal((x @ torch.eye(64, device=device)).cpu(), x.cpu()))
    if thread == "caller":
        refuse_then_launch()
    else:
        worker = threading.Thread(target=refuse_then_launch)
        worker.start()
        worker.join()
    assert codes == [CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED, True]
    assert "ALREADY_REGISTERED" in locker.describe(codes[0])
    free_host_buffer(buffer)
    assert locker.unregister(buffer.data.data_ptr()) != 0, "free must have unlocked it"
    torch.ones(1, device=device).sum().item()  # and that refusal left nothing behind either


@needs_cuda
def test_pinned_layers_copied_from_whole_page_buffers_stay_bitwise_exact_on_cuda():
    torch.manual_seed(0)
    model, x = Stack(), torch.randn(3, 8)
    with torch.no_grad():
        expected = model.cuda()(x.cuda()).cpu()
    streamer = apply_layer_streaming(model, "cuda", StreamingConfig(
        hosting={f"blocks.{i}": HostingTier.PINNED for i in range(4)}))
    assert all(layer.tier is HostingTier.PINNED for layer in streamer.layers)
    assert all(t.is_pinned() and t.data_ptr() % PAGE_BYTES == 0 for layer in streamer.layers for t in layer.host_tensors())
    with torch.no_grad():
        assert torch.equal(model(x.cuda()).cpu(), expected)
    streamer.remove()
