"""Plan a pipeline for a GPU without one: ``offload-serve plan --model wan2.1-t2v-14b --gpu L4 --host-ram 64GiB``.

``--tp N`` plans the stages that have a tensor-parallel plan (the umT5 encoder) as one of N ranks holds
them: each rank its own GPU, its slice kept on it.

Plans a real-size model from configs/models/real_model_configs.json (``--model``) or a local
diffusers folder of any family the service serves (``--model-dir FOLDER`` or just ``FOLDER``; its
requests at its flagship's published defaults, offload_core/planner/folders.py), built on torch's meta device, and prints a readable table, or
one JSON object with ``--json``. Bad arguments exit with status 2 and a message naming them.

Run by ``offload-serve plan`` in the user's own process.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Callable

from offload_core.planner import real_models
from offload_core.planner.folders import folder_facts
from offload_core.planner.inputs import GiB, gpu_spec, real_model_facts
from offload_core.planner.pipeline_plan import PerformanceMode, PipelinePlan
from offload_core.planner.search import plan_pipeline

_UNITS = {"": 1, "b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
          "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}


def parse_bytes(text: str) -> int:
    """``64GiB``, ``512MB``, ``1073741824`` -> bytes."""
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*", text)
    if not match or match.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"not a byte size: {text!r} (try 64GiB, 512MB)")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def _parser(prog: str = "offload-serve plan") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", help="a real model in configs/models/real_model_configs.json, e.g. wan2.1-t2v-14b")
    source.add_argument("--model-dir", type=Path, help="a local diffusers pipeline folder (of a family the service "
                        "serves), planned at its flagship's published defaults")
    source.add_argument("folder", nargs="?", type=Path, help="the same as --model-dir FOLDER")
    p.add_argument("--gpu", required=True, help="a GPU in the config file's 'gpus', e.g. L4, H100")
    p.add_argument("--host-ram", required=True, type=parse_bytes, help="host RAM of the node, e.g. 64GiB")
    p.add_argument("--mode", default="auto", choices=[m.value for m in PerformanceMode])
    p.add_argument("--working-set", type=parse_bytes,
                   help="device memory kept for activations (default: what the larger of one Denoiser forward and "
                        "one VAE decode at the request holds, measured on meta, 15%% over, at least 3GiB)")
    p.add_argument("--steps", type=int, help="denoising steps (default: the model's published default)")
    p.add_argument("--vae-tiling", choices=("on", "off"),
                   help="whether the decoder's VAE decodes tile by tile at its own tile (the service's decoder "
                        "vae_tiling); default: as the service's auto, the family's published usage (HunyuanVideo 1.5 "
                        "tiles, the others do not)")
    p.add_argument("--tp", type=int, default=1,
                   help="tensor-parallel ranks per stage replica: plans the stages with a TP plan as one rank holds them")
    p.add_argument("--shift", type=float, help="a two-expert model's timestep shift, which decides each expert's "
                   "steps (default: the model's published sampling shift, 12.0 for wan2.2-t2v-a14b; a folder's: its "
                   "scheduler's, which the service runs)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.add_argument("--picture", type=_picture_path, metavar="PATH.svg|PATH.png",
                   help="also draw the plan: per component its weights by where they live, and one pass "
                        "over its layers on the copy and compute streams as the cost model predicts it")
    return p


def _picture_path(text: str) -> Path:
    path = Path(text)
    if path.suffix.lower() not in (".svg", ".png"):
        raise argparse.ArgumentTypeError(f"--picture {text!r}: the file must end in .svg or .png")
    return path


def table(plan: PipelinePlan) -> str:
    """A readable table: one row per component, then the totals and the plan's reasons."""
    gib = 2**30
    rows = [("component", "strategy", "resident", "depth", "pinned/pageable", "in use GiB", "idle GiB",
             "moved GiB/req", "time s/req")]
    for c in plan.components:
        p = c.prediction
        tiers = dict.fromkeys(("pinned", "pageable"), 0)
        for _, tier in c.hosting:
            tiers[tier.value] = tiers.get(tier.value, 0) + 1
        layers = len(c.hosting)
        strategy = c.strategy.value + ("+park" if p.parked else "") + ("+tables" if c.host_tables else "")
        rows.append((c.name, strategy, f"{c.resident_layers}/{layers}" if layers else "-",
                     str(c.prefetch_depth) if layers else "-",
                     f"{tiers['pinned']}/{tiers['pageable']}" if layers else "-",
                     f"{p.in_use_bytes / gib:.2f}", f"{p.idle_bytes / gib:.2f}", f"{p.bytes_moved / gib:.1f}",
                     f"{p.time_s:.1f}"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)) for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join([plan.explain()[0], "", *lines, "", *plan.notes])


def expert_residency(plan: PipelinePlan) -> tuple[str, ...]:
    """For a two-expert plan: where each expert is while the other runs (its idle bytes on the device)."""
    phases = [s for s in plan.stages if s.name.startswith("denoise:")]
    if len(phases) < 2:
        return ()
    lines = []
    for stage in phases:
        (running,) = stage.components
        for other in (s.components[0] for s in phases if s is not stage):
            c = plan.component(other)
            where = ("resident: both experts on the device" if c.strategy.value == "resident" else
                     f"{c.strategy.value}{', parked' if c.prediction.parked else ''}, "
                     f"{c.resident_layers} of {len(c.hosting)} layers kept")
            lines.append(f"while {running} runs, {other} is {where} ({c.prediction.idle_bytes / 2**30:.2f} GiB idle "
                         f"on the device); stage {stage.name} peaks at "
                         f"{plan_stage_bytes(plan, stage) / 2**30:.2f} GiB")
    return tuple(lines)


def plan_stage_bytes(plan: PipelinePlan, stage) -> int:
    return sum(c.prediction.in_use_bytes if c.name in stage.components else c.prediction.idle_bytes
               for c in plan.components)


def _vae_tiled(args, tiles_by_default: Callable[[str], bool] | None) -> bool:
    if args.vae_tiling is not None:
        return args.vae_tiling == "on"
    if tiles_by_default is None:
        return False
    if args.model:
        try:
            return tiles_by_default(real_models.pipeline_class(args.model))
        except real_models.UnknownModel:
            return False  # real_model_facts says what the names are
    index = args.model_dir / "model_index.json"
    return index.is_file() and tiles_by_default(json.loads(index.read_text()).get("_class_name", ""))


def main(argv: list[str] | None = None, prog: str = "offload-serve plan",
         tiles_by_default: Callable[[str], bool] | None = None) -> int:
    """``prog``: how the user called it (``offload-serve plan``), for usage and error lines. ``tiles_by_default``:
    whether the family serving a pipeline class tiles its VAE when the user does not say (the service's
    ``vae_tiling: auto``; deployments/models/vae_tiling.py); None: untiled."""
    parser = _parser(prog)
    args = parser.parse_args(argv)
    if args.steps is not None and args.steps < 1:
        parser.error(f"--steps must be >= 1, got {args.steps}")
    if args.tp < 1:
        parser.error(f"--tp must be >= 1, got {args.tp}")
    if args.shift is not None and args.shift <= 0:  # a flow-match shift scales sigma: 0 puts every step at t=0
        parser.error(f"--shift must be > 0, got {args.shift:g}")
    args.model_dir = args.model_dir or args.folder
    if args.tp > 1 and args.model_dir:
        parser.error("--tp plans a real model (--model); a folder's stages are planned at tp 1")
    if args.host_ram <= 0:
        parser.error(f"--host-ram must be > 0, got {args.host_ram} B")
    try:
        gpu = gpu_spec(args.gpu)
        if args.working_set is not None and args.working_set >= gpu.memory_bytes:
            raise ValueError(f"--working-set {args.working_set / GiB:.2f} GiB leaves no room for weights on the "
                             f"{gpu.name}'s {gpu.memory_bytes / GiB:.2f} GiB")
        tiled = _vae_tiled(args, tiles_by_default)
        if args.model:
            facts, notes = real_model_facts(args.model, gpu, args.host_ram, working_set=args.working_set,
                                            steps=args.steps, tp_size=args.tp, flow_shift=args.shift,
                                            vae_tiled=tiled)
        else:
            if not (args.model_dir / "model_index.json").is_file():
                raise ValueError(f"--model-dir {args.model_dir} has no model_index.json: not a diffusers folder")
            facts, notes = folder_facts(args.model_dir, gpu, args.host_ram, working_set=args.working_set,
                                        steps=args.steps, flow_shift=args.shift, vae_tiled=tiled)
    except ValueError as error:
        parser.error(str(error))
    plan = plan_pipeline(facts, PerformanceMode(args.mode))
    plan = type(plan)(**{**plan.__dict__, "notes": (*plan.notes, *notes, *expert_residency(plan))})
    if args.json:
        print(json.dumps(plan.to_dict()))
    else:
        print(table(plan))
    if args.picture is not None:
        from offload_core.planner.picture import plan_picture, render

        args.picture.write_bytes(render(plan_picture(plan), args.picture.suffix.lower().lstrip(".")))
        print(f"picture of the plan written to {args.picture}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
