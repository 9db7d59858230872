"""The launch thread's stream reads and switches (``cuda_streams``), against a fake of torch's C calls.

They run on CUDA only; the fake keeps torch's semantics: ``_cuda_setStream`` makes the stream's
device current, and each device has its own current stream.
"""
from __future__ import annotations

import threading

import pytest

from offload_core.streaming import cuda_streams

DEFAULT, COMPUTE, COPY = (0, 0, 1), (7, 0, 1), (9, 0, 1)


class FakeStream:
    def __init__(self, raw):
        self.stream_id, self.device_index, self.device_type = raw


class FakeCuda:
    def __init__(self, device: int = 0):
        self.device = device
        self.current = {0: COMPUTE, 1: (0, 1, 1)}
        self.fallbacks: list[str] = []
        self.lock = threading.Lock()

    def current_device(self) -> int:
        return self.device

    def current_stream(self, index: int):
        return self.current[index]

    def set_stream(self, stream_id: int, index: int, kind: int) -> None:
        self.device = index  # as torch's _cuda_setStream: the stream's device becomes current
        self.current[index] = (stream_id, index, kind)

    def stream_from(self, raw):
        return FakeStream(raw)

    def stream_context(self, stream):
        fake = self

        class Context:
            def __enter__(self):
                fake.fallbacks.append("enter")
                self.device, self.previous = fake.device, fake.current[stream.device_index]
                fake.set_stream(stream.stream_id, stream.device_index, stream.device_type)

            def __exit__(self, *exc):
                fake.fallbacks.append("exit")
                fake.current[stream.device_index] = self.previous
                fake.device = self.device

        return Context()

    def api(self) -> cuda_streams.CudaApi:
        return cuda_streams.CudaApi(self.current_device, self.current_stream, self.set_stream, self.stream_from,
                                    self.stream_context)


@pytest.fixture
def fake(monkeypatch):
    cuda = FakeCuda()
    monkeypatch.setattr(cuda_streams, "api", cuda.api())
    return cuda


def test_copies_go_to_the_copy_stream_and_the_compute_stream_comes_back(fake):
    with cuda_streams.StreamSwitch(FakeStream(COPY), COPY):
        assert fake.current[0] == COPY
    assert fake.current[0] == COMPUTE and fake.device == 0 and not fake.fallbacks


def test_the_compute_stream_comes_back_when_a_copy_raises(fake):
    with pytest.raises(RuntimeError, match="copy failed"):
        with cuda_streams.StreamSwitch(FakeStream(COPY), COPY):
            raise RuntimeError("copy failed")
    assert fake.current[0] == COMPUTE


def test_a_thread_whose_current_device_is_another_switches_through_torch_and_keeps_its_device(fake):
    fake.device = 1
    with cuda_streams.StreamSwitch(FakeStream(COPY), COPY):
        assert fake.current[0] == COPY
    assert fake.fallbacks == ["enter", "exit"]
    assert fake.device == 1 and fake.current[0] == COMPUTE


def test_one_stream_object_per_stream_seen_and_all_of_them_remembered(fake):
    streams = cuda_streams.CurrentStreams(type("D", (), {"index": 0})())
    first = streams.current()
    assert streams.current() is first and cuda_streams.raw(first) == COMPUTE
    fake.current[0] = DEFAULT  # the caller switched its compute stream
    second = streams.current()
    assert cuda_streams.raw(second) == DEFAULT
    assert {cuda_streams.raw(s) for s in streams.seen()} == {COMPUTE, DEFAULT}
