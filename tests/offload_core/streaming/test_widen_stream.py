"""FP8 layers widened on their own stream behind two landing buffers (``streaming.ring``), on the simulator.

On the copy stream a layer's widen sat between its DMA and the next layer's; on its own stream it
overlaps the next DMA. The orderings that makes necessary are checked against the simulator's clock:
the DMA into a landing buffer after the widen that last read it, compute after its layer's widen,
and a later copy into the bytes of a layer released before it ran after that layer's widen.
"""
from __future__ import annotations

import pytest
import torch

from offload_core.host.tier import HostingTier
from offload_core.quant import WeightFormat, fake_quantize_
from offload_core.streaming.engine import StreamingConfig, apply_layer_streaming
from testing.sim import SimDevice, SimLink, SimStream, StreamHazardError
from tests.offload_core.streaming.test_sim import _keys
from tests.offload_core.streaming.test_skip import _skipping_after_first_block
from tests.offload_core.tiny_models import WAN

# A slow widen (a quarter of the DMA's rate) keeps each one busy past the next layer's copy, so a
# missing wait is a hazard on the clock, not a race that happens to be won.
LINK = SimLink(pinned_Bps=1e9, widen_Bps=0.25e9, launch_s=1e-6)


def _fp8_sim(remove_after, depth: int = 1, resident: int = 0):
    model, reference = WAN.build(), WAN.build()
    reference.load_state_dict(model.state_dict())
    fake_quantize_(reference.blocks)
    sim = SimDevice(LINK)
    streamer = remove_after(apply_layer_streaming(model, sim, StreamingConfig(
        weights=WeightFormat.FP8, prefetch_depth=depth, resident=resident, hosting={key: HostingTier.PINNED for key in _keys(model)})))
    sim.register_streamer(streamer)
    sim.charge_layer_compute(streamer, {layer.key: 1e-6 for layer in streamer.layers}, kernels=2)
    assert sim.charge_widen(streamer, launches=4) == len(streamer.layers)
    return model, reference, sim, streamer


@pytest.mark.parametrize("depth", [1, 2])
def test_fp8_layers_widen_on_their_own_stream_bitwise_and_hazard_free(depth, remove_after):
    model, reference, sim, streamer = _fp8_sim(remove_after, depth)
    inputs = WAN.inputs()
    expected = WAN.run(reference, inputs)
    for _ in range(2):
        assert torch.equal(WAN.run(model, inputs), expected)
    widen_end, copy_end = sim.stream_ready(SimStream.WIDEN), sim.stream_ready(SimStream.COPY)
    assert widen_end > copy_end > 0, "the last widen runs after the last DMA, on its own stream"
    assert streamer.meter.peak_bytes == streamer.predicted_peak_bytes(), "both landing buffers are in the peak"


def test_a_copy_into_a_landing_buffer_its_widen_still_reads_is_a_hazard(remove_after, monkeypatch):
    # depth 2: three layers in flight, so the copy into a landing buffer does not already wait (through
    # the slot's last compute) for the layer that landed there before
    model, _, sim, streamer = _fp8_sim(remove_after, depth=2)
    ring = streamer.ring
    waits = sim.copy_waits

    def skip_landing_wait(event):  # the DMA's wait for the landing buffer's last widen, dropped
        if any(event is read for read in ring._landing_reads if read is not None):
            return
        waits(event)
    monkeypatch.setattr(sim, "copy_waits", skip_landing_wait)
    with pytest.raises(StreamHazardError, match="overwrites a buffer still in use"):
        WAN.run(model, WAN.inputs())


def test_a_layer_released_before_it_ran_holds_later_copies_behind_its_widen(remove_after, monkeypatch):
    # depth 2: the skipped use's restart releases layers copied and widened for nothing
    model, reference, sim, streamer = _fp8_sim(remove_after, depth=2)
    inputs = WAN.inputs()
    expected = WAN.run(reference, inputs)
    assert torch.equal(WAN.run(model, inputs), expected)
    undo = _skipping_after_first_block(model, streamer)
    WAN.run(model, inputs)
    undo()
    assert streamer.ring.wasted_copies >= 1
    assert torch.equal(WAN.run(model, inputs), expected), "hazard-free and bitwise after the restart"


def test_resident_fp8_layers_land_after_the_last_uses_widens(remove_after):
    # a resident layer is copied into the landing buffer at each use's start; the use before released
    # its slots, and the compute stream waited for every widen then (compute_waits_for_copies)
    model, reference, sim, streamer = _fp8_sim(remove_after, depth=2, resident=1)
    inputs = WAN.inputs()
    expected = WAN.run(reference, inputs)
    for _ in range(3):
        assert torch.equal(WAN.run(model, inputs), expected)
        streamer.finish_use()
