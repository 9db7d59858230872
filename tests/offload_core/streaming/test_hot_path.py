"""What the layer hooks do on the launch thread: no work a warm request repeats for nothing."""
from __future__ import annotations

import torch

from offload_core.host.tier import HostingTier
from offload_core.streaming.engine import StreamingConfig, apply_layer_streaming
from tests.offload_core.tiny_models import WAN


def test_copy_targets_are_sliced_once_per_place_not_at_every_copy(remove_after):
    model, inputs = WAN.build(), WAN.inputs()
    expected = WAN.run(WAN.build(), inputs)
    # Pinned layers and staged ones in turn: a staged layer's fill slices a staging buffer each time
    # (a new one per fill), a pinned layer's copy goes straight to its place in the window.
    hosting = {f"blocks.{i}": (HostingTier.PINNED, HostingTier.PAGEABLE)[i % 2] for i in range(len(model.blocks))}
    streamer = remove_after(apply_layer_streaming(model, "cpu", StreamingConfig(prefetch_depth=1, hosting=hosting)))
    sliced = []
    pinned = [layer for layer in streamer.layers if layer.tier is HostingTier.PINNED]
    assert len(pinned) == len(streamer.layers) // 2
    for layer in pinned:
        fill_pairs = layer.host.fill_pairs

        def counted(regions, fill_pairs=fill_pairs):
            sliced.append(regions)
            return fill_pairs(regions)
        layer.host.fill_pairs = counted
    per_request = []
    for _ in range(3):
        before, copied = len(sliced), streamer.ring.bytes_copied
        streamer.prepare_for_use()
        assert torch.equal(WAN.run(model, inputs), expected)
        streamer.finish_use()
        assert streamer.ring.bytes_copied > copied
        per_request.append(len(sliced) - before)
    # The first request makes each (layer, place) once; a warm request copies every layer again
    # into places it has seen, and slices nothing.
    assert 0 < per_request[0] <= sum(1 for position, _, _ in streamer.ring._places
                                     if streamer.ring._layers[position] in pinned)
    assert per_request[1:] == [0, 0]
