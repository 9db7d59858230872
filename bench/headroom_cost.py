"""What asking for headroom costs, per part (``headroom_us``): it is asked at decisions (once per
use by the parking gate and the prefetch ring), never per layer, and this says what each costs.

Cases: the fast path the ring takes when no neighbour holds an outstanding lease (one cached read);
a full headroom on the device (CPU: capacity minus the tracked meters; CUDA: ``mem_get_info`` and
``memory_stats``); the same when the answer needs every split block's size (CUDA: a
``memory_snapshot`` walk, with the cache fragmented into ``--segments`` segments with a hole each;
CPU: the fake allocator's block list); and the parking gate's decision. Median of ``--repeat``.

    OMP_NUM_THREADS=1 .venv/bin/python bench/headroom_cost.py --quick [--device cuda]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from offload_core.residency.parking import Parking  # noqa: E402
from offload_core.streaming.device import DeviceCapacity, get_device  # noqa: E402
from offload_core.streaming.headroom import CachedBlocks, Rounding  # noqa: E402

MiB = 1 << 20


def _median_us(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return round(statistics.median(times) * 1e6, 2)


def _fragment(device, segments: int) -> list:
    """CUDA: ``segments`` 64 MiB segments, each with a 12 MiB hole between live blocks."""
    held = []
    for _ in range(segments):
        torch.empty(64 * MiB, dtype=torch.uint8, device=device.device)
        blocks = [torch.empty(12 * MiB, dtype=torch.uint8, device=device.device) for _ in range(4)]
        del blocks[1]
        held.extend(blocks)
    return held


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--quick", action="store_true", help="fewer repeats")
    parser.add_argument("--segments", type=int, default=64, help="fragmented segments on CUDA")
    args = parser.parse_args()
    repeat = 200 if args.quick else 2000
    device = get_device(args.device)
    held = []
    if device.is_cuda:
        held = _fragment(device, args.segments)
    else:
        device.configure(DeviceCapacity(capacity_bytes=16 << 30))
        holes = (12 * MiB,) * args.segments  # the same shape of cache, as the fake allocator states it
        blocks = CachedBlocks(Rounding.CUDA_CACHING, 64 * MiB * args.segments, 0, sum(holes), 0, holes)
        device.set_allocator(lambda _device, detailed: blocks if detailed else
                             CachedBlocks(blocks.rounding, blocks.reserved, 0, blocks.split_free, 0, None))
    component = nn.Linear(1024, 1024).to(device.device)  # 4 MiB of non-layer weights to gate
    parking = Parking("bench", component, device.device, min_block=16 * MiB)
    figures = {
        "no_neighbours_fast_path_us": _median_us(lambda: device.wait_for_neighbours(16 * MiB, 2, 1.0, "bench"),
                                                 repeat),
        "headroom_stats_us": _median_us(lambda: device.headroom(16 * MiB, settled=lambda room: True), repeat),
        "headroom_with_block_sizes_us": _median_us(lambda: device.headroom(16 * MiB), repeat),
        "parking_gate_us": _median_us(parking.park_if_it_pays, repeat),
    }
    device.set_neighbours(lambda: 1)
    figures["neighbour_check_us"] = _median_us(lambda: device.wait_for_neighbours(16 * MiB, 2, 1.0, "bench"), repeat)
    device.set_neighbours(None)
    device.set_allocator(None)
    room = device.headroom(16 * MiB)
    del held
    print(f"device {device.device}, {args.segments} fragmented segments, median of {repeat}:")
    for name, value in figures.items():
        print(f"  {name:32s} {value:10.2f} us")
    print(f"  headroom now: {room.explain()}")
    print(json.dumps({"device": str(device.device), "segments": args.segments, "repeat": repeat, **figures}))


if __name__ == "__main__":
    main()
