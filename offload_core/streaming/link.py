"""The host->device link, measured on the device: pinned, pageable and staged bandwidth, once per process.

Three rates, one per way a tier's bytes reach the device: PINNED layers by DMA from page-locked
memory; model offload, parked weights and unstaged copies by the driver's pageable copy, timed
from memory that was written first (never-touched pages all map the one zero page, which the
driver copies faster than any real buffer); PAGEABLE and MAPPED layers staged, a host memcpy
into two pinned chunks pipelined with the DMA out of them, as the engine's staging ring does:
split over the copier threads the replica will run with (``fill_threads``: the probe's count
within the cap the node's replicas leave this one), so the plan prices staged tiers at the rate
the replica gets, not at whatever torch's intra-op threads gave one ``copy_``, and never above the
fill probe's memcpy out of uncached memory (:func:`staged_rate`).

Runtime, not planning: it allocates device memory and page-locks host memory, so it lives beside
the device, and the planner only reads its result (:class:`~offload_core.planner.facts.LinkFacts`).

It gives back everything it takes. The pinned source is this project's own page-locked buffer
(``host.pinned``: unlocked when done), not torch's pinned caching allocator, which would keep the
256 MiB block cached, locked and leased by no one for the life of the replica; the device buffer
is returned to the driver with ``empty_cache()`` (the allocator would otherwise keep 256 MiB
reserved). The result is kept per device, so replicas' stages in one process measure once.
"""
from __future__ import annotations

import logging
import time

import torch

from offload_core.host.pinned import allocate_host_buffer, free_host_buffer
from offload_core.planner.facts import LinkFacts
from offload_core.streaming import fill_threads
from offload_core.streaming.copier import FillSplitter

logger = logging.getLogger(__name__)

GB = 10**9
# 256 MiB: long enough that the copy runs at the link's sustained rate (a few ms at 25-55 GB/s),
# small enough to fit beside any model on a shared GPU for the instant it is held.
LINK_PROBE_BYTES = 256 * 1024 * 1024


def measure_link(device: torch.device | str, nbytes: int = LINK_PROBE_BYTES, repeats: int = 3,
                 copier_cap: int | None = None) -> LinkFacts:
    """Pinned, pageable and staged host->device bandwidth of ``device`` (CUDA), measured once per process.

    ``copier_cap``: the most threads a staging fill may split over (None: ``fill_threads.default_cap()``,
    this process alone on the node); the count chosen within it is ``LinkFacts.copier_threads``."""
    key = _key(device, nbytes, repeats, copier_cap)
    if key not in _MEASURED:
        _MEASURED[key] = _measured(*key)
    return _MEASURED[key]


def is_measured(device: torch.device | str, copier_cap: int, nbytes: int = LINK_PROBE_BYTES, repeats: int = 3) -> bool:
    """Whether this process measured ``device``'s link so already: :func:`measure_link` then takes nothing."""
    return _key(device, nbytes, repeats, copier_cap) in _MEASURED


def _key(device: torch.device | str, nbytes: int, repeats: int,
         copier_cap: int | None) -> tuple[torch.device, int, int, int]:
    """What a measurement is kept under: the CUDA device with its index, probe bytes, repeats, copier cap."""
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"host->device bandwidth is measured on CUDA, not {device}; configure LinkFacts instead")
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    cap = fill_threads.default_cap() if copier_cap is None else int(copier_cap)
    return device, int(nbytes), int(repeats), cap


def probe_host_bytes(nbytes: int = LINK_PROBE_BYTES, cache_bytes: int | None = None) -> int:
    """Host memory a process's first :func:`measure_link` holds at its peak, for the ~1-2 s it runs: the
    fill probe (``fill_threads.device_probe_host_bytes``, up to 1.06 GiB) and then this probe (pageable
    and pinned sources, two staging chunks), one after the other. ``cache_bytes``: None reads sysfs."""
    return max(fill_threads.device_probe_host_bytes(cache_bytes), 2 * nbytes + 2 * min(STAGE_CHUNK_BYTES, nbytes))


# 32 MiB chunks: a few ms of memcpy each, long against one copy's ~10 us issue cost, and two of
# them (the pinned memory the staged probe locks) are small beside any replica's staging ring.
STAGE_CHUNK_BYTES = 32 * 1024 * 1024


# (device, probe bytes, repeats, copier cap) -> what was measured: once per process.
_MEASURED: dict[tuple[torch.device, int, int, int], LinkFacts] = {}


def _measured(device: torch.device, nbytes: int, repeats: int, cap: int) -> LinkFacts:
    fills = fill_threads.device_probe(device, cap)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    pinned = allocate_host_buffer(nbytes, pin=True, device=device)
    chunks = [allocate_host_buffer(min(STAGE_CHUNK_BYTES, nbytes), pin=True, device=device) for _ in range(2)]
    try:
        pageable = torch.empty(nbytes, dtype=torch.uint8)
        pageable.fill_(1)  # written: real pages, not the zero page
        pageable_Bps = _bandwidth(dst, pageable, device, repeats, non_blocking=False)
        if pinned.page_locked and all(chunk.page_locked for chunk in chunks):
            pinned.data.fill_(1)
            pinned_Bps = _bandwidth(dst, pinned.data, device, repeats, non_blocking=True)
            staged_Bps = staged_rate(device, staged_bandwidth(dst, pageable, [chunk.data for chunk in chunks],
                                                              device, repeats, fills.threads), fills)
        else:
            # The driver refused to lock the probe: pinned copies (and so staging) are not
            # available to this process, so the planner must not count on them.
            refusal = next(b.refusal for b in (pinned, *chunks) if b.refusal is not None)
            logger.info("link %s: %s; pinned and staged bandwidth taken as the pageable figure",
                        device, refusal.explain())
            pinned_Bps = staged_Bps = pageable_Bps
    finally:
        for buffer in (pinned, *chunks):
            free_host_buffer(buffer)  # synchronises the device, then unlocks
        del dst
        torch.cuda.empty_cache()
    logger.info("link %s: pinned %.1f GB/s, pageable %.1f GB/s (written memory), staged %.1f GB/s (memcpy split "
                "over %d copier threads into 2 x %d MiB pinned chunks pipelined with the DMA) measured, %d MiB x %d; "
                "probe buffers freed", device, pinned_Bps / GB, pageable_Bps / GB, staged_Bps / GB, fills.threads,
                STAGE_CHUNK_BYTES >> 20, nbytes >> 20, repeats)
    return LinkFacts(pinned_Bps, pageable_Bps, measured=True, staged_Bps=staged_Bps,
                     copier_threads=fills.threads, host_memcpy_Bps=max(fills.rates_Bps))


def staged_rate(device: torch.device | str, probed_Bps: float, fills: fill_threads.FillProbe) -> float:
    """The staged rate the plan prices: the staged probe's, never above the best host memcpy the fill
    probe measured. A fill's memcpy bounds the pipeline it feeds. The fill probe reads slices no cache
    holds (``fill_threads``); this probe copies one 256 MiB source four times, and a last-level cache can
    hold part of it (an EPYC's 32 MiB per core complex is what one of 8 copier threads reads of it). The
    fill probe's one cached source read 41.7-48.0 GB/s on the H200's host, where 1 GiB copies gave 28.3."""
    bound = max(fills.rates_Bps, default=0.0)
    if bound <= 0 or probed_Bps <= bound:
        return probed_Bps
    logger.info("link %s: staged probe %.1f GB/s is above the host memcpy out of uncached memory (%.1f GB/s over "
                "1..%d threads): staged tiers priced at %.1f GB/s, the memcpy that bounds every fill",
                device, probed_Bps / GB, bound / GB, len(fills.rates_Bps), bound / GB)
    return bound


def staged_bandwidth(dst: torch.Tensor, src: torch.Tensor, chunks: list[torch.Tensor], device: torch.device,
                     repeats: int, threads: int) -> float:
    """``src`` to ``dst`` through the pinned ``chunks`` in turn: memcpy into one (split over ``threads``,
    as the copier's fills are) while the other's DMA runs."""
    copy_stream = torch.cuda.Stream(device=device)
    splitter = FillSplitter(threads, "offload-link-probe")
    done: list[torch.cuda.Event | None] = [None] * len(chunks)

    def once() -> None:
        for index, offset in enumerate(range(0, src.numel(), chunks[0].numel())):
            chunk = chunks[index % len(chunks)]
            if done[index % len(chunks)] is not None:
                done[index % len(chunks)].synchronize()  # its last DMA landed (a blocking event: no spin)
            n = min(chunk.numel(), src.numel() - offset)
            splitter.copy([(chunk[:n], src[offset:offset + n])])
            with torch.cuda.stream(copy_stream):
                dst[offset:offset + n].copy_(chunk[:n], non_blocking=True)
                event = torch.cuda.Event(blocking=True)
                event.record(copy_stream)
            done[index % len(chunks)] = event

    try:
        once()  # warm-up
        torch.cuda.synchronize(device)
        start = time.perf_counter()
        for _ in range(repeats):
            once()
        torch.cuda.synchronize(device)
    finally:
        splitter.close()
    return dst.numel() * repeats / (time.perf_counter() - start)


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
