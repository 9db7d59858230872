"""Host memory of a fresh process holding the medium Wan DiT under the streaming engine.

Each figure comes from its own fresh process (so no allocator state leaks between modes) and is
read from /proc/self/smaps_rollup: ``Anonymous`` (private memory only swap can reclaim) and
``Rss - Anonymous`` (file-backed and shared pages the kernel can drop). A baseline child imports
exactly what the others import (torch, diffusers, offload_core) and loads nothing; its
anonymous bytes are subtracted, so a ratio is the weights' own anonymous cost:

    <mode>_anon_ratio = (Anonymous(mode) - Anonymous(baseline)) / weight bytes

- ``loaded``: diffusers ``from_pretrained`` only. In diffusers 0.42 (low_cpu_mem_usage, the
  default) same-dtype weights stay views of the safetensors mapping, so this is ~0; the child
  checks the mapped share with offload_core.host.maps and reports it, because if a loader ever copies
  the weights out the other ratios would measure the loader, not the engine.
- ``pageable``: every layer PAGEABLE (consolidated into flat anonymous buffers, originals freed):
  target <= 1.05, i.e. no second copy anywhere.
- ``mapped``: every layer MAPPED (left as views of the mapping): target <= 0.05.

The processes are forked from a multiprocessing forkserver that has imported torch, diffusers and
offload_core once (importing diffusers takes 7-14 s of this 2-core machine; paying it once per
mode would blow the 40 s quick budget). A forked process counts the server's anonymous pages in
its own Anonymous too, and the baseline is forked the same way, so the subtraction cancels them.

Usage: ``python bench/host_memory.py [--quick]``; the last line printed is one JSON object; a ratio
over its target exits 1 and is listed in its ``failed`` (``bench/checks.py``).
"""
from __future__ import annotations

import argparse
import multiprocessing
import multiprocessing.forkserver
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MODES = ("baseline", "loaded", "pageable", "mapped")
MiB = 1024**2
# What every measured process has imported before it forks: the baseline's whole content.
PRELOAD = ["torch", "diffusers.models.transformers.transformer_wan", "offload_core.streaming.engine",
           "offload_core.host.maps"]


def smaps_rollup() -> dict[str, int]:
    """Bytes per field of /proc/self/smaps_rollup (the kernel reports kB)."""
    fields = {}
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines()[1:]:
        name, value = line.split(":", 1)
        fields[name] = int(value.split()[0]) * 1024
    return fields


def child(mode: str, folder: str) -> dict:
    """Run in a fresh process: load (or not), apply the engine, measure."""
    import gc

    import torch
    from diffusers import WanTransformer3DModel

    from offload_core.host.maps import MapsSnapshot
    from offload_core.host.tier import HostingTier
    from offload_core.streaming.engine import StreamingConfig, apply_layer_streaming

    torch.set_num_threads(1)
    result = {"mode": mode}
    if mode != "baseline":
        model = WanTransformer3DModel.from_pretrained(folder).eval()
        params = list(model.parameters()) + list(model.buffers())
        result["weight_bytes"] = sum(t.numel() * t.element_size() for t in params)
        result["loaded_mapped_bytes"] = MapsSnapshot.take().mapped_bytes(params)
        if mode in ("pageable", "mapped"):
            tier = HostingTier.PAGEABLE if mode == "pageable" else HostingTier.MAPPED
            keys = [f"blocks.{i}" for i in range(len(model.blocks))]
            streamer = apply_layer_streaming(model, torch.device("cpu"),
                                             StreamingConfig(hosting={k: tier for k in keys}))
            result["layer_bytes"] = sum(layer.nbytes for layer in streamer.layers)
            result["host_layer_bytes"] = sum(layer.host.nbytes for layer in streamer.layers)
    gc.collect()
    rollup = smaps_rollup()
    result["anonymous"] = rollup["Anonymous"]
    result["file_rss"] = rollup["Rss"] - rollup["Anonymous"]
    return result


def run_children(folder: Path, repeats: int) -> dict[str, list[dict]]:
    """Every mode ``repeats`` times, each in a fresh forked process (maxtasksperchild=1)."""
    ctx = multiprocessing.get_context("forkserver")
    tasks = [(mode, str(folder)) for _ in range(repeats) for mode in MODES]
    with ctx.Pool(processes=2, maxtasksperchild=1) as pool:
        results = pool.starmap(child, tasks, chunksize=1)
    runs: dict[str, list[dict]] = {mode: [] for mode in MODES}
    for result in results:
        runs[result["mode"]].append(result)
    return runs


TARGETS = {"pageable_anon_ratio": 1.05, "mapped_anon_ratio": 0.05}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one fresh process per mode (< 40 s)")
    parser.add_argument("--repeats", type=int, default=None, help="fresh processes per mode (default 3, quick 1)")
    args = parser.parse_args()
    sys.path.insert(0, str(REPO))
    from bench import checks

    figures = measure(args.repeats or (1 if args.quick else 3))
    return checks.finish(figures, [checks.at_most(name, figures[name], target) for name, target in TARGETS.items()])


def measure(repeats: int) -> dict:
    """Every mode in ``repeats`` fresh processes each; prints the table, returns the figures."""
    started = time.perf_counter()
    os.environ.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    # Start the forkserver's imports now, so they run while this process builds or finds the model.
    multiprocessing.set_forkserver_preload(PRELOAD)
    multiprocessing.forkserver.ensure_running()
    from zoo.tiny import ensure_medium_wan

    folder = ensure_medium_wan() / "transformer"
    runs = run_children(folder, repeats)
    base = statistics.median(r["anonymous"] for r in runs["baseline"])
    weight = runs["loaded"][0]["weight_bytes"]

    def ratio(mode: str) -> float:
        return round(statistics.median(r["anonymous"] - base for r in runs[mode]) / weight, 4)

    figures = {
        "model": "medium-wan transformer", "weight_bytes": weight, "repeats": repeats,
        "layer_bytes": runs["pageable"][0]["layer_bytes"],
        "pageable_host_layer_bytes": runs["pageable"][0]["host_layer_bytes"],
        "baseline_anonymous": base,
        "loaded_mapped_fraction": round(runs["loaded"][0]["loaded_mapped_bytes"] / weight, 4),
        "loaded_anon_ratio": ratio("loaded"),
        "pageable_anon_ratio": ratio("pageable"),
        # Only the streamed layers are consolidated (non-layer weights stay mapped on a CPU
        # device), so this is the "no second copy" figure per byte actually copied.
        "pageable_anon_over_layer_bytes": round(
            statistics.median(r["anonymous"] - base for r in runs["pageable"]) / runs["pageable"][0]["layer_bytes"], 4),
        "mapped_anon_ratio": ratio("mapped"),
        "targets": TARGETS,
    }
    figures["seconds"] = round(time.perf_counter() - started, 1)
    print(f"{'mode':<10}{'anon - baseline (MiB)':>24}{'file-backed RSS (MiB)':>24}{'ratio':>8}")
    for mode in MODES[1:]:
        anon = statistics.median(r["anonymous"] - base for r in runs[mode]) / MiB
        file_rss = statistics.median(r["file_rss"] for r in runs[mode]) / MiB
        print(f"{mode:<10}{anon:>24.1f}{file_rss:>24.1f}{ratio(mode):>8.3f}")
    print(f"weights {weight / MiB:.1f} MiB, of which streamed layers {figures['layer_bytes'] / MiB:.1f} MiB; "
          f"baseline anonymous {base / MiB:.1f} MiB")
    return figures


if __name__ == "__main__":
    sys.exit(main())
