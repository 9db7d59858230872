"""Ray's address file: a stopped head's is taken back, another head's is left alone.

The lockdown itself (a driver without the token refused on the node's other address, one with it let
in) is checked on the head `offload-serve serve` starts: tests/deployments/dev/test_serve_command.py.
"""
from __future__ import annotations

from deployments.dev import local_ray


def test_an_address_file_naming_another_head_is_left_alone(tmp_path):
    (tmp_path / "ray_current_cluster").write_text("10.0.0.7:6380")
    assert local_ray.forget_address(6379, str(tmp_path)) is False
    assert (tmp_path / "ray_current_cluster").read_text() == "10.0.0.7:6380"
    assert local_ray.forget_address(6380, str(tmp_path)) is True
    assert not (tmp_path / "ray_current_cluster").exists()
