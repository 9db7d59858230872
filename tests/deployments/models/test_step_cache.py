"""The step cache: off is the plain forward, a skip reuses the request's cached residual, a full skip copies nothing more."""
from __future__ import annotations

import pytest
import torch

from deployments.models.step_cache import CachedRequest, StepCache
from offload_core.streaming.engine import StreamingConfig, apply_layer_streaming
from tests.offload_core.tiny_models import FLUX, WAN


def _batch_of_two(case):
    """Two requests' rows in one batch: the tiny case's inputs, twice, the second slightly changed."""
    one = case.inputs()
    two = {}
    for name, value in one.items():
        if name in ("hidden_states", "encoder_hidden_states", "pooled_projections", "timestep"):
            other = value + 0.25 if value.is_floating_point() and name != "timestep" else value
            two[name] = torch.cat([value, other])
        else:
            two[name] = value
    return two


@pytest.mark.parametrize("case", [WAN, FLUX], ids=lambda c: c.name)
def test_threshold_zero_and_a_threshold_never_met_are_the_plain_forward_bitwise(case):
    model, inputs = case.build(), _batch_of_two(case)
    plain = case.run(model, inputs)
    cache = StepCache(model)
    requests = [CachedRequest(0.0), CachedRequest(0.0)]
    with cache.active(requests, [[0], [1]]):
        assert torch.equal(case.run(model, inputs), plain)
    requests = [CachedRequest(1e-30), CachedRequest(1e-30)]  # decides every step, never skips
    moved = dict(inputs, hidden_states=inputs["hidden_states"] + 0.5)
    for step_inputs in (inputs, moved):
        with cache.active(requests, [[0], [1]]):
            assert torch.equal(case.run(model, step_inputs), case.run(case.build(), step_inputs))
    assert [r.skipped for r in requests] == [0, 0] and [r.decided for r in requests] == [2, 2]


@pytest.mark.parametrize("case", [WAN, FLUX], ids=lambda c: c.name)
def test_a_request_that_skips_reuses_its_residual_while_the_other_computes_on_the_sub_batch(case):
    model, inputs = case.build(), _batch_of_two(case)
    cache = StepCache(model)
    skipper, computer = CachedRequest(0.5), CachedRequest(0.0)
    with cache.active([skipper, computer], [[0], [1]]):
        first = case.run(model, inputs)
    changed = dict(inputs, hidden_states=inputs["hidden_states"].clone())
    changed["hidden_states"][1:] += 0.5  # only the second request's latents move
    with cache.active([skipper, computer], [[0], [1]]):
        second = case.run(model, changed)
    assert skipper.skipped == 1 and computer.skipped == 0
    # Unchanged inputs: the same first block output plus the residual the rest added (first + (out - first)).
    torch.testing.assert_close(second[0], first[0], rtol=0, atol=1e-6)
    alone = case.run(model, {k: (v[1:] if k in ("hidden_states", "encoder_hidden_states", "pooled_projections",
                                                   "timestep") else v) for k, v in changed.items()})
    torch.testing.assert_close(second[1:], alone, rtol=0, atol=1e-5)  # a sub-batch of one: rounding only
    assert cache.all_skipped == 0


@pytest.mark.parametrize("depth", [1, 2])
def test_when_every_request_skips_no_later_block_is_copied_and_at_most_depth_copies_are_wasted(depth, remove_after):
    model, inputs = WAN.build(), _batch_of_two(WAN)
    streamer = remove_after(apply_layer_streaming(model, "cpu", StreamingConfig(prefetch_depth=depth)))
    cache = StepCache(model)
    requests = [CachedRequest(0.1), CachedRequest(0.1)]
    with cache.active(requests, [[0], [1]]):
        computed = WAN.run(model, inputs)
    streamer.reset_counters()
    with cache.active(requests, [[0], [1]]):
        skipped = WAN.run(model, inputs)
    torch.testing.assert_close(skipped, computed, rtol=0, atol=1e-6)
    assert cache.all_skipped == 1
    assert [r.skipped for r in requests] == [1, 1]
    per_layer = streamer.layers[0].layout.nbytes
    # Block 0 ran; then the next step's window was fetched; nothing of blocks beyond it.
    assert streamer.ring.wasted_copies <= depth
    assert streamer.bytes_copied <= (1 + streamer.ring.n_slots) * per_layer < len(streamer.layers) * per_layer + per_layer
    streamer.reset_counters()
    with cache.active([CachedRequest(0.0), CachedRequest(0.0)], [[0], [1]]):
        assert torch.equal(WAN.run(model, inputs), computed), "the next step runs every block again"
    assert streamer.ring.out_of_order_entries == 0
