"""Fixtures shared by the offload_core tests."""
from __future__ import annotations

import gc

import pytest

from offload_core.streaming.device import DeviceFacts, get_device


@pytest.fixture
def cpu_capacity():
    """Configure the CPU device's capacity (the headroom fact) for one test, then restore it.

    CPU headroom counts the weight bytes of every live tracked meter. Earlier tests' streamers may
    linger until the collector frees them, so they are collected first and the collector is held
    off for the test: only what the test itself creates, closes or drops changes the headroom.
    """
    device = get_device("cpu")
    before = device.facts
    gc.collect()
    gc.disable()
    try:
        yield lambda nbytes: device.configure(DeviceFacts(capacity_bytes=nbytes))
    finally:
        gc.enable()
        gc.collect()  # this test's own streamers go before the next test measures
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
