"""The host->device link, measured on the device: pinned and pageable bandwidth, once per process.

Runtime, not planning: it allocates device memory and page-locks host memory, so it lives beside
the device, and the planner only reads its result (:class:`~offload_core.planner.facts.LinkFacts`).

It gives back everything it takes. The pinned source is this project's own page-locked buffer
(``host.pinned``: unlocked when done), not torch's pinned caching allocator, which would keep the
256 MiB block cached, locked and leased by no one for the life of the replica; the device buffer
is returned to the driver with ``empty_cache()`` (the allocator would otherwise keep 256 MiB
reserved). The result is kept per device, so replicas' stages in one process measure once.
"""
from __future__ import annotations

import functools
import logging

import torch

from offload_core.host.pinned import allocate_host_buffer, free_host_buffer
from offload_core.planner.facts import LinkFacts

logger = logging.getLogger(__name__)

GB = 10**9
# 256 MiB: long enough that the copy runs at the link's sustained rate (a few ms at 25-55 GB/s),
# small enough to fit beside any model on a shared GPU for the instant it is held.
LINK_PROBE_BYTES = 256 * 1024 * 1024


def measure_link(device: torch.device | str, nbytes: int = LINK_PROBE_BYTES, repeats: int = 3) -> LinkFacts:
    """Pinned and pageable host->device bandwidth of ``device`` (CUDA), measured once per process."""
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"host->device bandwidth is measured on CUDA, not {device}; configure LinkFacts instead")
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return _measured(device, int(nbytes), int(repeats))


@functools.lru_cache(maxsize=None)
def _measured(device: torch.device, nbytes: int, repeats: int) -> LinkFacts:
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    pinned = allocate_host_buffer(nbytes, pin=True, device=device)
    try:
        pageable = torch.empty(nbytes, dtype=torch.uint8)
        pageable_Bps = _bandwidth(dst, pageable, device, repeats, non_blocking=False)
        if pinned.page_locked:
            pinned_Bps = _bandwidth(dst, pinned.data, device, repeats, non_blocking=True)
        else:
            # The driver refused to lock the probe: pinned copies are not available to this
            # process, so the planner must not count on them.
            logger.info("link %s: %s; pinned bandwidth taken as the pageable figure",
                        device, pinned.refusal.explain())
            pinned_Bps = pageable_Bps
    finally:
        free_host_buffer(pinned)  # synchronises the device, then unlocks
        del dst
        torch.cuda.empty_cache()
    logger.info("link %s: pinned %.1f GB/s, pageable %.1f GB/s (measured, %d MiB x %d; probe buffers freed)",
                device, pinned_Bps / GB, pageable_Bps / GB, nbytes >> 20, repeats)
    return LinkFacts(pinned_Bps, pageable_Bps, measured=True)


def _bandwidth(dst: torch.Tensor, src: torch.Tensor, device: torch.device, repeats: int, *,
               non_blocking: bool) -> float:
    dst.copy_(src, non_blocking=non_blocking)  # warm-up: first-touch and driver set-up
    torch.cuda.synchronize(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        dst.copy_(src, non_blocking=non_blocking)
    end.record()
    torch.cuda.synchronize(device)
    return dst.numel() * repeats / (start.elapsed_time(end) / 1e3)
