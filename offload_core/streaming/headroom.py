"""Headroom: what allocations of a given size can still get on a device, and where each byte comes from.

"Driver free + (reserved - allocated)" over-promises twice. The caching allocator's cached bytes
are not one block: a free block inside a segment that also holds live tensors serves only a
request that fits in it, and small-pool blocks never serve a request of 1 MiB or more. And the
driver's free memory ignores bytes the node ledger leased to a neighbour process that has not
allocated them yet: counting on them takes them from under the neighbour. So the question asked
is "how many bytes can allocations of at least ``min_block`` bytes get, without a neighbour's
lease", answered from:

- ``driver_free``: what the driver (CUDA) or the configured capacity (CPU) can still give;
- ``reclaimable``: cached segments with no live block: a failed ``cudaMalloc`` makes the
  allocator free them and retry (``empty_cache`` returns exactly these), so they count as new
  memory;
- the free blocks inside segments still in use, each only if it is at least ``min_block``
  (their sizes come from ``torch.cuda.memory_snapshot()``, read only when the total could matter);
- ``neighbours_outstanding``: bytes other processes on this device leased and do not hold yet
  (set by the replica: offload_core never asks the ledger itself);
- ``cap_room``: with ``torch.cuda.set_per_process_memory_fraction``, a new segment is refused once
  the reserved bytes would pass the cap.

CUDA's caching allocator (c10/cuda/CUDACachingAllocator.cpp, torch 2.x): a request is rounded up
to 512 B; requests up to 1 MiB come from the small pool (2 MiB segments), larger ones from the
large pool, whose new segments are 20 MiB for requests under 10 MiB and the request rounded up to
2 MiB above. With ``expandable_segments`` the large pool is one growing mapping per stream, so
nothing is a whole free segment: its free blocks are counted as blocks, never as reclaimable.
"""
from __future__ import annotations

import enum
import os
from dataclasses import dataclass, field

import torch

SMALL_REQUEST = 1 << 20  # kSmallSize: requests up to this size come from the small pool
MIN_BLOCK = 512  # kMinBlockSize: every request is rounded up to a multiple of it
SMALL_SEGMENT = 2 << 20  # kSmallBuffer: the small pool's segment
LARGE_SEGMENT = 20 << 20  # kLargeBuffer: a large-pool segment for requests under 10 MiB
MIN_LARGE_ALLOC = 10 << 20  # kMinLargeAlloc: from here segments are the request rounded to 2 MiB
ROUND_LARGE = 2 << 20  # kRoundLarge


class Rounding(enum.Enum):
    """How a device turns a request into memory taken."""

    EXACT = "exact"  # CPU: a request takes its own bytes, nothing is cached between uses
    CUDA_CACHING = "cuda_caching"  # torch's CUDA caching allocator's rounding, pools and segments


def _round_up(nbytes: int, unit: int) -> int:
    return -(-int(nbytes) // unit) * unit


def block_bytes(nbytes: int, rounding: Rounding) -> int:
    """The block a request of ``nbytes`` occupies."""
    return int(nbytes) if rounding is Rounding.EXACT else _round_up(max(1, nbytes), MIN_BLOCK)


def segment_bytes(nbytes: int, rounding: Rounding) -> int:
    """The new device memory a request of ``nbytes`` needs when no cached block serves it."""
    if rounding is Rounding.EXACT:
        return int(nbytes)
    if nbytes <= SMALL_REQUEST:
        return SMALL_SEGMENT
    if nbytes < MIN_LARGE_ALLOC:
        return LARGE_SEGMENT
    return _round_up(nbytes, ROUND_LARGE)


@dataclass(frozen=True)
class CachedBlocks:
    """The allocator's cached (reserved, not in use) memory, by what it can still serve."""

    rounding: Rounding = Rounding.EXACT
    reserved: int = 0  # bytes held from the driver, in use or cached
    reclaimable: int = 0  # whole free segments: given back and retried on a failed cudaMalloc
    split_free: int = 0  # large-pool free blocks inside segments that also hold live blocks
    small_free: int = 0  # small-pool free blocks inside used segments: only requests <= 1 MiB
    # Sizes of the large pool's split free blocks (memory_snapshot); None: not read, only the total.
    split_blocks: tuple[int, ...] | None = ()
    cap_bytes: int | None = None  # the process cap (set_per_process_memory_fraction); None: none

    @property
    def cached_free(self) -> int:
        """Every cached byte not in use: what the old headroom figure counted."""
        return self.reclaimable + self.split_free + self.small_free


@dataclass(frozen=True)
class Headroom:
    """What allocations of at least ``min_block`` bytes can get now, with the parts that make it."""

    min_block: int  # the request size asked about (0: any size)
    driver_free: int  # what the driver (CPU: the configured capacity) can still give
    neighbours_outstanding: int  # leased by other processes on this device, not allocated yet
    blocks: CachedBlocks = field(default_factory=CachedBlocks)
    usable_blocks: tuple[int, ...] = ()  # cached free blocks that serve a request of min_block

    @property
    def cached_free(self) -> int:
        return self.blocks.cached_free

    @property
    def largest_cached_block(self) -> int:
        """The largest cached free block a request of ``min_block`` could be served from."""
        return max(self.usable_blocks, default=0)

    @property
    def cached_usable(self) -> int:
        return sum(self.usable_blocks)

    @property
    def new_memory(self) -> int:
        """Bytes new segments may take: the driver's free bytes no neighbour counts on, plus what a
        failed allocation reclaims, within the process cap."""
        room = max(0, self.driver_free - self.neighbours_outstanding) + self.blocks.reclaimable
        if self.blocks.cap_bytes is not None:
            room = min(room, max(0, self.blocks.cap_bytes - self.blocks.reserved) + self.blocks.reclaimable)
        return room

    @property
    def usable_bytes(self) -> int:
        """Bytes allocations of at least ``min_block`` can get: new memory + cached blocks big enough."""
        return self.new_memory + self.cached_usable

    def allocations(self, nbytes: int) -> int:
        """How many allocations of ``nbytes`` succeed one after another (cached blocks first)."""
        if nbytes <= 0:
            raise ValueError(f"nbytes must be > 0, got {nbytes}")
        block = block_bytes(nbytes, self.blocks.rounding)
        from_cache = sum(b // block for b in self.usable_blocks)
        segment = segment_bytes(nbytes, self.blocks.rounding)
        return from_cache + (self.new_memory // segment) * max(1, segment // block)

    def fits(self, nbytes: int) -> bool:
        """Can one allocation of ``nbytes`` succeed now without a neighbour's leased bytes?"""
        return nbytes <= 0 or self.allocations(nbytes) >= 1

    def explain(self) -> str:
        parts = [f"{self.usable_bytes} B usable by blocks >= {self.min_block} B = driver free {self.driver_free} B"]
        if self.neighbours_outstanding:
            parts.append(f"- neighbours' outstanding leases {self.neighbours_outstanding} B")
        if self.blocks.reclaimable:
            parts.append(f"+ reclaimable free segments {self.blocks.reclaimable} B")
        if self.blocks.cap_bytes is not None:
            parts.append(f"(process cap {self.blocks.cap_bytes} B, {self.blocks.reserved} B reserved)")
        if self.cached_free:
            parts.append(f"+ cached blocks big enough {self.cached_usable} B of {self.cached_free} B cached "
                         f"(largest {self.largest_cached_block} B)")
        return " ".join(parts)

    def to_json(self) -> dict:
        return {"min_block_bytes": self.min_block, "usable_bytes": self.usable_bytes,
                "driver_free_bytes": self.driver_free, "reclaimable_bytes": self.blocks.reclaimable,
                "cached_free_bytes": self.cached_free, "largest_cached_block_bytes": self.largest_cached_block,
                "neighbours_outstanding_bytes": self.neighbours_outstanding, "cap_bytes": self.blocks.cap_bytes}


class HeadroomTimeout(RuntimeError):
    """Bytes a neighbour process leased kept an allocation from fitting for the whole bounded wait."""

    def __init__(self, what: str, nbytes: int, waited_s: float, headroom: Headroom):
        self.what, self.nbytes, self.waited_s, self.headroom = what, nbytes, waited_s, headroom
        super().__init__(f"{what}: {nbytes} B did not fit beside neighbours' leases after {waited_s:.1f} s: "
                         f"{headroom.explain()}")


def usable_blocks(blocks: CachedBlocks, min_block: int) -> tuple[int, ...] | None:
    """The cached free blocks requests of ``min_block`` bytes can be served from; None when that
    needs the split blocks' sizes and ``blocks`` has only their total.

    ``min_block`` 0 asks about requests of any size: every cached byte counts (the old figure).
    Up to 1 MiB a request is served by the small pool only; above, by large-pool blocks it fits in.
    """
    if min_block <= 0:
        return tuple(b for b in (blocks.split_free, blocks.small_free) if b)
    if blocks.rounding is Rounding.EXACT:
        return tuple(b for b in (blocks.split_blocks or ()) if b >= min_block)
    need = block_bytes(min_block, blocks.rounding)
    if min_block <= SMALL_REQUEST:
        # Small blocks are at most one 2 MiB segment each: counted as one total of the pool.
        return (blocks.small_free,) if blocks.small_free >= need else ()
    if not blocks.split_free:
        return ()
    if blocks.split_blocks is None:
        return None
    return tuple(b for b in blocks.split_blocks if b >= need)


def expandable_segments() -> bool:
    """Whether the CUDA allocator grows one mapping per stream (PYTORCH_CUDA_ALLOC_CONF)."""
    conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "") + "," + os.environ.get("PYTORCH_ALLOC_CONF", "")
    return "expandable_segments:true" in conf.replace(" ", "").lower()


def cuda_cached_blocks(device: torch.device, detailed: bool) -> CachedBlocks:
    """The CUDA allocator's cache from ``memory_stats`` (cheap); ``detailed`` also reads every split
    free block's size from ``memory_snapshot`` (a walk of every segment: only at decisions)."""
    stats = torch.cuda.memory_stats(device)
    reserved = stats.get("reserved_bytes.all.current", 0)
    # active, not allocated: a block freed while a stream still reads it is not free yet.
    free = reserved - stats.get("active_bytes.all.current", 0)
    split_large = stats.get("inactive_split_bytes.large_pool.current", 0)
    split_small = stats.get("inactive_split_bytes.small_pool.current", 0)
    reclaimable = max(0, free - split_large - split_small)
    if expandable_segments():  # one growing segment: its free bytes are blocks, never whole segments
        split_large, reclaimable = split_large + reclaimable, 0
    total = torch.cuda.get_device_properties(device).total_memory
    # torch < 2.6 cannot say; the service sets the cap itself (deployments/replica/leases.py) on newer ones.
    get_fraction = getattr(torch.cuda, "get_per_process_memory_fraction", None)
    fraction = get_fraction(device) if get_fraction is not None else 1.0
    cap = None if fraction >= 1.0 else int(fraction * total)
    sizes = _snapshot_free_blocks(device) if detailed and split_large else None
    return CachedBlocks(Rounding.CUDA_CACHING, reserved, reclaimable, split_large, split_small,
                        sizes if sizes is not None else (() if not split_large else None), cap)


def _snapshot_free_blocks(device: torch.device) -> tuple[int, ...]:
    """Sizes of the large pool's free blocks inside segments that still hold a live block."""
    sizes = []
    for segment in torch.cuda.memory_snapshot():
        if segment.get("device") != device.index or segment.get("segment_type") != "large":
            continue
        blocks = segment.get("blocks", ())
        whole_free = not segment.get("is_expandable") and all(b["state"] == "inactive" for b in blocks)
        if not whole_free:  # a whole free segment is reclaimable, counted apart
            sizes.extend(b["size"] for b in blocks if b["state"] == "inactive")
    return tuple(sizes)
