"""bench/serve_hops.py: a timed request split into hops and stages, and what each adds over Serve's floor."""
from __future__ import annotations

import pytest

from bench.serve_hops import PARTS, STAGES, timeline, where_it_goes


def test_a_requests_parts_follow_its_stage_stamps_and_add_up_to_its_wall_time():
    stamps = [{"started_at": 100.010, "seconds": 0.050}, {"started_at": 100.070, "seconds": 0.020},
              {"started_at": 100.095, "seconds": 0.008}]
    parts = timeline(100.000, 100.110, stamps)
    assert list(parts) == list(PARTS)
    assert parts == pytest.approx({"in": 0.010, "encode": 0.050, "encode_to_denoise": 0.010, "denoise": 0.020,
                                   "denoise_to_decode": 0.005, "decode": 0.008, "out": 0.007})
    assert sum(parts.values()) == pytest.approx(0.110)


def test_over_the_floor_a_stage_counts_beyond_in_process_out_beyond_png_and_the_rest_is_named():
    service = dict.fromkeys(PARTS, 0.010) | {"encode": 0.060}
    floor = dict.fromkeys(PARTS, 0.008) | dict.fromkeys(STAGES, 0.0)
    in_process = {"encode": 0.050, "denoise": 0.010, "decode": 0.010, "png": 0.001}
    over_floor_s = 0.030
    rows, over = where_it_goes(service, floor, in_process, offload_s=-0.004, over_floor_s=over_floor_s)
    assert rows["encode"] == {"service": 60.0, "floor": 0.0, "in_process": 50.0}
    assert over["encode"] == pytest.approx(10.0) and over["denoise"] == pytest.approx(0.0)
    assert over["in"] == pytest.approx(2.0) and over["out"] == pytest.approx(1.0), "out pays the PNG in process too"
    assert over["offload_in_process"] == -4.0
    # Every millisecond of the figure is in a named part: what medians do not add up to included.
    assert sum(over.values()) == pytest.approx(over_floor_s * 1e3)
