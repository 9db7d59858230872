"""A fake of the CUDA caching allocator's block state, so headroom decisions are tested on CPU."""
from __future__ import annotations

from offload_core.streaming.headroom import CachedBlocks


class FakeAllocator:
    """The CUDA caching allocator's block state, as ``cuda_cached_blocks`` would read it; counts how
    often the detailed (snapshot) view was asked for."""

    def __init__(self, blocks: CachedBlocks):
        self.blocks, self.detailed_reads = blocks, 0

    def __call__(self, device, detailed: bool) -> CachedBlocks:
        if detailed:
            self.detailed_reads += 1
            return self.blocks
        return CachedBlocks(self.blocks.rounding, self.blocks.reserved, self.blocks.reclaimable,
                            self.blocks.split_free, self.blocks.small_free,
                            None if self.blocks.split_free else (), self.blocks.cap_bytes)
