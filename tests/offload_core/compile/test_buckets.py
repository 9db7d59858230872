"""Request-shape buckets: parsed from the config, and the block-call rules learned from one eager pass per shape."""
from __future__ import annotations

import pytest

from offload_core.compile.buckets import DynamicDim, RequestShape, learn_rules, parse_bucket


def test_a_bucket_entry_is_shapes_joined_by_commas_frames_one_when_left_out():
    bucket = parse_bucket("832x480x21, 1280x720")
    assert bucket.shapes == (RequestShape(480, 832, 21), RequestShape(720, 1280, 1))
    assert bucket.name == "832x480x21,1280x720" and RequestShape(720, 1280) in bucket
    for bad in ("832x", "832x480x0", "axb", ""):
        with pytest.raises(ValueError, match="WxH or WxHxF"):
            parse_bucket(bad)


def test_dims_that_vary_across_the_bucket_are_dynamic_in_its_range_and_the_rest_must_match():
    # hidden_states (batch, tokens, width), a non-tensor leaf, rotary (tokens, dim): as a block sees them
    runs = [[((1, 32, 24), None, (32, 12))], [((1, 64, 24), None, (64, 12))], [((1, 128, 24), None, (128, 12))]]
    (rule,) = learn_rules("b", runs)
    assert rule.dynamic == (DynamicDim(0, 1, 32, 128), DynamicDim(2, 0, 32, 128))
    assert rule.matches(((1, 96, 24), None, (96, 12)))
    assert not rule.matches(((1, 256, 24), None, (256, 12))), "outside the bucket's range"
    assert not rule.matches(((2, 64, 24), None, (64, 12))), "a static dim differs"
    assert not rule.matches(((1, 64, 24), (1,), (64, 12))), "a tensor where the bucket has none"


def test_a_dim_that_is_one_at_some_shape_stays_static_and_a_changed_structure_is_refused():
    (rule,) = learn_rules("b", [[((1, 32),)], [((2, 32),)]])
    assert rule.dynamic == ()  # dynamo specializes size 1: compiled per size instead
    with pytest.raises(ValueError, match="change structure"):
        learn_rules("b", [[((1, 32),)], [((1, 32, 4),)]])
