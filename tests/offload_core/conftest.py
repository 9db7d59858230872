"""Fixtures shared by the offload_core tests."""
from __future__ import annotations

import gc

import pytest

from offload_core.streaming.device import DeviceCapacity, get_device


def collect_lingering_meters(device) -> None:
    """A full collection when the device still tracks a meter (a live streamer's, or one of a streamer
    dropped in a reference cycle that only the collector frees); none when it tracks none, since then
    nothing that lingers is counted in headroom. A full collection walks every object of the test
    process: 0.3 s with torch, diffusers and transformers imported, more in a suite's worker, twice per
    test for the 42 tests that use the fixture; a test that removes its streamers leaves none tracked."""
    if len(device._meters):  # a WeakSet: a meter still in it is alive, or garbage not yet collected
        gc.collect()


@pytest.fixture
def cpu_capacity():
    """Configure the CPU device's capacity (the headroom fact) for one test, then restore it.

    CPU headroom counts the weight bytes of every live tracked meter. Earlier tests' streamers may
    linger until the collector frees them, so they are collected first and the collector is held
    off for the test: only what the test itself creates, closes or drops changes the headroom.
    """
    device = get_device("cpu")
    before = device.facts
    collect_lingering_meters(device)
    gc.disable()
    try:
        yield lambda nbytes: device.configure(DeviceCapacity(capacity_bytes=nbytes))
    finally:
        gc.enable()
        collect_lingering_meters(device)  # this test's own streamers go before the next test measures
        device.configure(before)


@pytest.fixture
def cpu_device(cpu_capacity):
    """The CPU device with a configured capacity; its neighbours and allocator are reset after."""
    device = get_device("cpu")
    try:
        yield device, cpu_capacity
    finally:
        device.set_neighbours(None)
        device.set_allocator(None)
