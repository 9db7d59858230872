"""The current CUDA stream, read and switched from the launch thread at the cost of one C call each.

Run in whichever thread launches a stage's kernels (``streaming.device`` calls it in the hooks).
Every streamed layer reads the current (compute) stream twice and switches to the copy stream and
back once. torch's Python wrappers build a ``Stream`` object per read and a ``StreamContext``
per switch (current device, current stream, two ``torch.device`` comparisons on each side): on
the H200 the hooks alone took 60.7 us per layer against 15-22 us on CPU, where none of this runs,
and these calls are most of what runs only on CUDA. Here a read is ``_cuda_getCurrentStream``'s
tuple, looked up in a cache of ``Stream`` objects, and a switch is ``_cuda_setStream`` there and
back, when the calling thread's current device is the stream's (the engine's device, always in
the service); otherwise ``torch.cuda.stream`` does it, device switch included.

The C entry points (``compat.torch.cuda_stream_calls``) are looked up on first use (a CPU build of
torch has none) through :data:`api`, which tests replace with a fake.
"""
from __future__ import annotations

from typing import Any, Callable, NamedTuple

import torch

from compat.torch import cuda_stream_calls

RawStream = tuple  # (stream_id, device_index, device_type): how torch._C packs a stream


class CudaApi(NamedTuple):
    """The three calls, a ``Stream`` from its tuple, and the fallback context for a switch across devices."""

    current_device: Callable[[], int]
    current_stream: Callable[[int], RawStream]
    set_stream: Callable[[int, int, int], None]
    stream_from: Callable[[RawStream], Any]
    stream_context: Callable[[Any], Any]


def _stream_from(found: RawStream):
    return torch.cuda.Stream(stream_id=found[0], device_index=found[1], device_type=found[2])


def _torch_api() -> CudaApi:
    torch.cuda.init()  # what torch.cuda.current_stream does first (a no-op once CUDA is up)
    return CudaApi(*cuda_stream_calls(), _stream_from, torch.cuda.stream)


api: CudaApi | None = None  # resolved on first use; tests assign a fake


def _api() -> CudaApi:
    global api
    if api is None:
        api = _torch_api()
    return api


def raw(stream) -> RawStream:
    return (stream.stream_id, stream.device_index, stream.device_type)


class StreamSwitch:
    """``with StreamSwitch(stream):`` launches go to ``stream``, as under ``torch.cuda.stream(stream)``.

    One per entry (it holds the stream it restores), so threads launching on one device never share one."""

    __slots__ = ("_stream", "_raw", "_previous", "_fallback")

    def __init__(self, stream, stream_raw: RawStream):
        self._stream, self._raw = stream, stream_raw
        self._previous: RawStream | None = None
        self._fallback = None

    def __enter__(self) -> None:
        calls = _api()
        index = self._raw[1]
        if calls.current_device() != index:
            self._fallback = calls.stream_context(self._stream)  # switches the device too, and back
            self._fallback.__enter__()
            return
        self._previous = calls.current_stream(index)
        calls.set_stream(*self._raw)

    def __exit__(self, *exc) -> None:
        if self._fallback is not None:
            self._fallback.__exit__(*exc)
            return
        _api().set_stream(*self._previous)


class CurrentStreams:
    """The current stream of one device as a ``torch.cuda.Stream``, one object per stream ever seen."""

    def __init__(self, device: torch.device):
        self._index = device.index
        self._seen: dict[RawStream, Any] = {}

    def current(self):
        calls = _api()
        found = calls.current_stream(self._index)
        stream = self._seen.get(found)
        if stream is None:
            stream = self._seen[found] = calls.stream_from(found)
        return stream

    def seen(self) -> tuple:
        """Every stream :meth:`current` returned so far."""
        return tuple(self._seen.values())
