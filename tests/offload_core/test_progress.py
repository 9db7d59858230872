"""Hosting a model's layers says how much, how long and how fast, once, when it is done."""
from __future__ import annotations

import logging

from offload_core import StreamingConfig, apply_layer_streaming
from offload_core.progress import ByteProgress
from tests.offload_core.tiny_models import Stack


def test_hosting_a_models_layers_logs_their_bytes_time_and_rate_once(caplog, remove_after):
    model = Stack()
    with caplog.at_level(logging.INFO, logger="offload_core.progress"):
        streamer = remove_after(apply_layer_streaming(model, "cpu", StreamingConfig()))
    (line,) = [r.getMessage() for r in caplog.records if r.name == "offload_core.progress"]
    hosted = sum(layer.layout.host_nbytes for layer in streamer.layers)
    assert line.startswith(f"hosting layers (pageable): {len(streamer.layers)} layers, {hosted / 2**30:.3f} GiB in ")
    assert line.endswith(" GB/s)")


def test_no_bar_outside_a_terminal_and_the_counts_add_up(caplog):
    with caplog.at_level(logging.INFO, logger="offload_core.progress"):
        with ByteProgress("pinning", 2**30) as progress:
            assert progress._bar is None  # pytest's stderr is not a terminal
            progress.update(2**29)
            progress.update(2**29)
    assert "pinning: 2 layers, 1.000 GiB in " in caplog.records[-1].getMessage()
