"""A component used once per request (wrap_uses=False): its last layers prefetch no next use, so a
request copies each streamed layer once, bitwise the plain model, as the planner predicts."""
from __future__ import annotations

import pytest
import torch

from offload_core.buffers import window_copies
from offload_core.streaming.engine import StreamingConfig, apply_layer_streaming
from tests.offload_core.tiny_models import WAN


@pytest.mark.parametrize("depth", [1, 2])
def test_a_once_per_request_component_copies_each_layer_once_per_request(depth, remove_after):
    model, inputs = WAN.build(), WAN.inputs()
    expected = WAN.run(WAN.build(), inputs)
    streamer = remove_after(apply_layer_streaming(model, "cpu", StreamingConfig(prefetch_depth=depth,
                                                                                wrap_uses=False)))
    layer_bytes = sum(layer.layout.nbytes for layer in streamer.layers)
    for _ in range(2):  # two requests: prepare, one use, finish
        streamer.reset_counters()
        streamer.prepare_for_use()
        assert torch.equal(WAN.run(model, inputs), expected)
        streamer.finish_use()
        assert streamer.bytes_copied == layer_bytes, "a layer copied for a next use the request never makes"
    sizes = [layer.layout.nbytes for layer in streamer.layers]
    assert streamer.ring.copies_per_request(1) == window_copies(sizes, streamer.ring.window_bytes, 1, wrap=False) \
        == len(sizes)


def test_uses_that_wrap_prefetch_the_next_use_and_copy_its_window_once_more(remove_after):
    model, inputs = WAN.build(), WAN.inputs()
    streamer = remove_after(apply_layer_streaming(model, "cpu", StreamingConfig(prefetch_depth=1)))
    streamer.prepare_for_use()
    WAN.run(model, inputs)
    streamer.finish_use()
    n = len(streamer.layers)
    assert streamer.bytes_copied == (n + streamer.ring.n_slots) * streamer.layers[0].layout.nbytes
