"""The batching projection runs on the simulated accelerator and obeys the physics it models."""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from batching_projection import project  # noqa: E402


def test_a_streamed_step_is_never_faster_than_its_copies_or_its_compute():
    result = project(batches=(1, 4))
    assert result["layers"] == 57, "FLUX.1-dev: 19 double-stream + 38 single-stream blocks"
    for row in result["rtx4090_streamed"]:
        # The weights cross the link once per step whatever the batch; compute grows with it.
        assert row["step_s"] >= max(row["copy_s"], row["compute_s"]) * 0.999
        assert row["step_s"] <= (row["copy_s"] + row["compute_s"]) * 1.001
    one, four = result["rtx4090_streamed"]
    assert four["copy_s"] == one["copy_s"] and four["images_per_hour"] > one["images_per_hour"]
