"""A use cut short (a step cache skipped the rest of the layers): no skipped layer is copied past the window."""
from __future__ import annotations

import pytest
import torch

from offload_core.streaming.engine import StreamingConfig, apply_layer_streaming
from tests.offload_core.tiny_models import WAN


def _skipping_after_first_block(model, streamer):
    """Make every later block an identity and tell the engine after block 0, as the step cache does."""
    originals = {}
    for block in list(model.blocks)[1:]:
        originals[block] = block.forward
        block.forward = lambda hidden_states, *args, **kwargs: hidden_states
    handle = model.blocks[0].register_forward_hook(lambda *_: streamer.skip_rest_of_use())

    def undo():
        handle.remove()
        for block, forward in originals.items():
            block.forward = forward
    return undo


@pytest.mark.parametrize("resident", [0, 1])
@pytest.mark.parametrize("depth", [1, 2])
def test_a_skipped_use_copies_at_most_depth_wasted_layers_and_the_next_use_is_bitwise(depth, resident, remove_after):
    model, inputs = WAN.build(), WAN.inputs()
    expected = WAN.run(WAN.build(), inputs)
    streamer = remove_after(apply_layer_streaming(model, "cpu", StreamingConfig(prefetch_depth=depth,
                                                                                resident=resident)))
    assert torch.equal(WAN.run(model, inputs), expected)  # a full use; its last layer prefetches the next
    streamer.reset_counters()
    WAN.run(model, inputs)
    steady = streamer.bytes_copied  # what a use copies after a full use
    per_layer = streamer.layers[-1].layout.nbytes  # the tiny Wan's blocks are all alike
    undo = _skipping_after_first_block(model, streamer)
    streamer.reset_counters()
    WAN.run(model, inputs)  # the skipped use
    undo()
    ring = streamer.ring
    assert ring.skipped_restarts == 1 and ring.wasted_copies <= depth
    # What the skipped use copied: block 0 if streamed, the next use's window, and nothing more.
    streamed_block0 = 0 if resident else 1
    assert streamer.bytes_copied <= (streamed_block0 + ring.n_slots) * per_layer
    assert not any(layer.materialized for layer in streamer.layers[1:] if not layer.resident
                   and layer.position >= ring.n_slots), "a skipped layer outside the next window was copied"
    streamer.reset_counters()
    assert torch.equal(WAN.run(model, inputs), expected), "the use after a skip computes as before"
    assert ring.out_of_order_entries == 0, "the window was already the next use's: nothing entered out of order"
    # Its whole first window was fetched by the skipped use, as a full use's last layer fetches it
    # as it exits: the next use copies what a steady one does.
    assert streamer.bytes_copied == steady
