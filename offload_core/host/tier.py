"""Where a streamed layer's weights live on the host between uses."""
from __future__ import annotations

import enum


class HostingTier(enum.Enum):
    # Page-locked: copies run asynchronously at full link speed (~25 GB/s PCIe Gen4 x16), but the
    # kernel can never reclaim it, so every byte is leased from the node budget. On CUDA it is
    # its own anonymous mapping rounded up to whole pages (< 4 KiB more) and locked in place
    # (cudaHostRegister), not through torch's caching allocator, which rounds each block up to a
    # power of two (1.2 GiB -> 2 GiB). Without CUDA: planned and accounted as pinned, allocated
    # pageable. A lock the driver refuses makes the layer PAGEABLE (logged, in the plan's notes).
    PINNED = "pinned"
    # An anonymous (private) copy in ordinary memory: copies go through the driver's staging
    # buffer, synchronously, at a third to half of pinned speed.
    PAGEABLE = "pageable"
    # Left as zero-copy views of the safetensors file mapping: costs no anonymous memory, the
    # page cache may drop it, and a copy may fault pages in from disk.
    MAPPED = "mapped"

    # Members are singletons compared by identity: hash them so too. Enum's own __hash__ is a Python
    # call on the member's name, and a plan search hashes every layer's tier in its memo keys (12.5 M
    # calls, a third of planning SD3.5-Large).
    __hash__ = object.__hash__


# Tiers whose host->device copies the CUDA driver would stage itself, blocking the calling thread:
# the engine copies them through its own pinned staging buffers instead (streaming/staging.py).
STAGED_TIERS = frozenset({HostingTier.PAGEABLE, HostingTier.MAPPED})
