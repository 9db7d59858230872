"""Progress of a long host-side step (hosting and pinning a model's layers when a replica starts).

One INFO line when it ends, with the bytes, the seconds and the rate; while it runs, a tqdm bar
when stderr is a terminal (never in a Ray worker's log file). Runs in the process that loads the
model: a stage replica, the demo, a benchmark.
"""
from __future__ import annotations

import logging
import sys
import time

logger = logging.getLogger(__name__)

# Below this a step takes milliseconds: no bar (it would only flicker), the line is still logged.
BAR_MIN_BYTES = 256 * 2**20


class ByteProgress:
    """``update(nbytes)`` per piece done; ``close()`` logs ``what``: bytes, seconds and rate."""

    def __init__(self, what: str, total_bytes: int, unit_label: str = "layers"):
        self.what, self.total, self.done, self.pieces, self.label = what, total_bytes, 0, 0, unit_label
        self.start = time.perf_counter()
        self._bar = None
        if total_bytes >= BAR_MIN_BYTES and sys.stderr.isatty():
            from tqdm import tqdm  # a dependency of diffusers and huggingface_hub

            self._bar = tqdm(total=total_bytes, unit="B", unit_scale=True, unit_divisor=1024, desc=what,
                             leave=False)

    def update(self, nbytes: int) -> None:
        self.done += nbytes
        self.pieces += 1
        if self._bar is not None:
            self._bar.update(nbytes)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        seconds = time.perf_counter() - self.start
        logger.info("%s: %d %s, %.3f GiB in %.2f s (%.2f GB/s)", self.what, self.pieces, self.label,
                    self.done / 2**30, seconds, self.done / max(seconds, 1e-9) / 1e9)

    def __enter__(self) -> ByteProgress:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
