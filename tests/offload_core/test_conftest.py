"""tests/offload_core/conftest.py's ``cpu_capacity``: a meter an earlier test left in a reference cycle is
collected before the next test measures headroom, and only then is the full collection paid."""
from __future__ import annotations

import gc
import weakref

from torch import nn

from offload_core.streaming.device import get_device
from offload_core.streaming.meter import DeviceWeightMeter
from tests.offload_core.conftest import collect_lingering_meters


def test_a_meter_dropped_in_a_reference_cycle_is_collected_before_the_next_test_measures():
    device = get_device("cpu")
    gc.disable()  # as during a cpu_capacity test: the cycle lingers until someone collects
    try:
        cycle = [DeviceWeightMeter(nn.Linear(10, 10), "cpu", track_headroom=True)]
        cycle.append(cycle)
        meter = weakref.ref(cycle[0])
        del cycle
        assert meter() is not None and meter() in device._meters, "a cycle keeps it tracked without a collection"
        collect_lingering_meters(device)
        assert meter() is None, "collected, so no longer tracked"
    finally:
        gc.enable()
