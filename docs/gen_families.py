"""Writes the families table of README.md and docs/models.md from the adapters and the planner.

Each row is one kind of diffusers folder the service serves (``offload_core.planner.folders.FOLDER_KINDS``):
the family adapter in ``deployments/models/`` that recognises it (its ``/v1/models`` family and what it
serves), the published defaults of its flagship in ``configs/models/real_model_configs.json`` (the
request the planner plans), and, from the planner at real size on ``meta`` with 64 GiB of host RAM,
the smallest GPU of the fleet profiles (``configs/fleet/fleet.yaml``) that runs it streamed (in that
profile's mode, as a replica there would) and the smallest that holds it all resident (speed mode).
A row the planner cannot plan says so ("—") with the planner's reason under the table.

``.venv/bin/python docs/gen_families.py`` rewrites the text between ``<!-- families:begin -->`` and
``<!-- families:end -->`` in both files; ``--check`` exits 1 when either differs (tests/docs does
the same). Run by hand in the user's shell and by the test suite; plans on ``meta``, needs no GPU.
"""
from __future__ import annotations

import argparse
import pathlib
import sys
from dataclasses import dataclass

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(ROOT))

from bench.gen_benchmarks import replace_between  # noqa: E402
from cluster.fleet import FleetProfile, load_fleet  # noqa: E402
from deployments.models import vae_tiling  # noqa: E402
from deployments.models.registry import adapters  # noqa: E402
from offload_core.planner import real_models  # noqa: E402
from offload_core.planner.folders import FOLDER_KINDS, FolderKind, Mark  # noqa: E402
from offload_core.planner.inputs import gpu_spec, real_model_facts  # noqa: E402
from offload_core.planner.pipeline_plan import PerformanceMode  # noqa: E402
from offload_core.planner.search import plan_pipeline  # noqa: E402

BEGIN, END = "<!-- families:begin -->", "<!-- families:end -->"
TARGETS = (ROOT / "README.md", ROOT / "docs" / "models.md")
HOST_RAM = 64 * 2**30
GIB = 2**30
NOT_PLANNED = "—"


@dataclass(frozen=True)
class FamilyRow:
    family: str
    folder: str
    serves: str
    planned_as: str
    streamed: str
    resident: str
    why_not: str = ""  # the planner's reason when it cannot plan the row


def kind_index(kind: FolderKind) -> dict:
    """A ``model_index.json`` of this kind: its pipeline class, its components and the mark of its variant."""
    index = {"_class_name": kind.pipeline}
    for name in real_models.component_names(kind.model):
        index[name] = ["diffusers", name]
    if kind.mark is Mark.EXPANDED_TIMESTEPS:
        index["expand_timesteps"] = True
    elif kind.mark is not Mark.NONE:
        index[kind.mark.value] = ["diffusers", kind.mark.value]
    return index


def adapter_family(kind: FolderKind) -> tuple[str, str]:
    """The ``/v1/models`` family and what it serves, from the adapter that takes a folder of this kind."""
    index = kind_index(kind)
    found = [a for a in adapters() if a.recognises(index)]  # the variant's mark is in the index
    if len(found) != 1:
        raise LookupError(f"{len(found)} adapters in deployments/models recognise {kind.describe()} "
                          f"({kind.pipeline}): {[a.family.value for a in found]}; exactly one must")
    return found[0].family.value, ", ".join(found[0].modalities(index))


def tiles_vae(model: str) -> bool:
    """Whether the service tiles this model's VAE by default (``vae_tiling: auto``: the family's published usage)."""
    return vae_tiling.published(real_models.pipeline_class(model))


def published(model: str) -> str:
    d = real_models.pipeline_defaults(model)
    frames = f", {d['num_frames']} frames" if "num_frames" in d else ""
    tiled = ", VAE tiled" if tiles_vae(model) else ""
    return (f"`{model}`: {d['width']}x{d['height']}{frames}, {d['num_inference_steps']} steps, "
            f"guidance {d['guidance_scale']:g}{tiled}")


def smallest_gpu(model: str, profiles: tuple[FleetProfile, ...], speed: bool) -> str:
    """The first profile's GPU (ascending memory) whose plan fits: in the profile's mode, or in speed mode."""
    for profile in profiles:
        gpu = gpu_spec(profile.accelerator_type)
        mode = PerformanceMode.SPEED if speed else profile.performance_mode()
        facts, _ = real_model_facts(model, gpu, HOST_RAM, vae_tiled=tiles_vae(model))
        plan = plan_pipeline(facts, mode)
        if plan.feasible:
            pinned = "" if speed else f", pins {plan.pinned_bytes / GIB:.1f} GiB"
            return (f"{gpu.name} ({gpu.memory_bytes / GIB:.0f} GiB): peak {plan.peak_device_bytes / GIB:.1f} GiB"
                    f"{'' if speed else ', ' + mode.value}{pinned}")
    return "none of the fleet's GPUs"


def family_row(kind: FolderKind, profiles: tuple[FleetProfile, ...]) -> FamilyRow:
    family, serves = adapter_family(kind)
    folder = f"`{kind.pipeline}`" + ("" if kind.mark is Mark.NONE else f" + `{kind.mark.value}`")
    try:
        streamed, resident = smallest_gpu(kind.model, profiles, False), smallest_gpu(kind.model, profiles, True)
    except (ValueError, LookupError, ImportError) as error:  # a family the planner cannot build on meta yet
        return FamilyRow(family, folder, serves, published(kind.model), NOT_PLANNED, NOT_PLANNED, str(error))
    return FamilyRow(family, folder, serves, published(kind.model), streamed, resident)


def families_table() -> str:
    profiles = tuple(p for p in load_fleet().profiles if p.accelerator_type)
    rows = [family_row(kind, profiles) for kind in FOLDER_KINDS]
    lines = ["| family (`/v1/models`) | folder (`model_index.json`) | serves | planned at (published defaults) "
             "| smallest GPU, streamed | smallest GPU, all resident |", "|---|---|---|---|---|---|"]
    lines += [f"| `{r.family}` | {r.folder} | {r.serves} | {r.planned_as} | {r.streamed} | {r.resident} |" for r in rows]
    gpus = ", ".join(p.accelerator_type for p in profiles)
    lines += ["", f"Generated by `docs/gen_families.py`: the planner at real size with 64 GiB of host RAM, on the fleet "
              f"profiles' GPUs ({gpus}). *Streamed*: the smallest that runs the flagship in its profile's mode "
              "(`configs/fleet/fleet.yaml`), with the device peak and the host RAM the plan pins with the node's "
              "64 GiB to itself (a smaller host budget pins less and keeps the rest pageable: docs/memory.md); "
              "*all resident*: the smallest in `speed` mode. The peak is the weights' on the device; beside them "
              "the plan keeps the larger of one Denoiser forward's and one VAE decode's activations at the published "
              "request free, measured on meta, 15 % over, at least 3 GiB (docs/memory.md: 20.2 GiB for Wan2.2-A14B "
              "at 720p), the decode tiled where the service tiles it by default (*VAE tiled*: `vae_tiling: auto`). Reproduce one: `offload-serve plan --model MODEL --gpu GPU --host-ram 64GiB --mode MODE`."]
    lines += [f"\n{NOT_PLANNED} `{r.family}`: {r.why_not}" for r in rows if r.why_not]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if a file's table differs from what this makes")
    args = parser.parse_args(argv)
    table = families_table()
    stale = []
    for path in TARGETS:
        text = path.read_text()
        new = replace_between(text, BEGIN, END, table, str(path.relative_to(ROOT)))
        if new != text:
            stale.append(path)
            if not args.check:
                path.write_text(new)
    for path in stale if args.check else ():
        print(f"{path.relative_to(ROOT)}'s families table is stale: run .venv/bin/python docs/gen_families.py",
              file=sys.stderr)
    return 1 if args.check and stale else 0


if __name__ == "__main__":
    sys.exit(main())
