"""Which adapter serves a folder: every module of ``deployments.models`` that defines ``ADAPTERS``.

Adding a family adds its module; nothing here changes. A folder no adapter recognises, or a
variant its adapter does not handle, is :class:`UnsupportedModelFolder` naming the supported
families (``build_app`` fails with it, so a deploy never comes up answering 404 to everything).
Run wherever a folder's family is asked: the ingress, the stage replicas, the planner CLI's callers.
:func:`check_weights` (file names only, no weights read) runs in ``build_app`` and ``doctor``, so a
folder a replica could not load is refused before any replica starts.
"""
from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import pathlib
import pkgutil
from functools import lru_cache

from deployments.models.adapter import FamilyAdapter, FamilyTraits, UnsupportedModelFolder, read_json
from deployments.wire.spec import Family, PipelineStage


@lru_cache(maxsize=1)
def adapters() -> tuple[FamilyAdapter, ...]:
    """Every family adapter, in module-name order (discovered once per process)."""
    package = importlib.import_module("deployments.models")
    found: list[FamilyAdapter] = []
    for info in sorted(pkgutil.iter_modules(package.__path__), key=lambda i: i.name):
        module = importlib.import_module(f"deployments.models.{info.name}")
        found.extend(getattr(module, "ADAPTERS", ()))
    return tuple(found)


def supported() -> str:
    """The supported families and the pipeline classes each serves, for error messages."""
    return "; ".join(f"{a.family.value} ({', '.join(a.pipeline_classes)})" for a in adapters())


def adapter_for(facts: FamilyTraits | Family) -> FamilyAdapter:
    family = facts.family if isinstance(facts, FamilyTraits) else Family(facts)
    for adapter in adapters():
        if adapter.family is family:
            return adapter
    raise UnsupportedModelFolder(f"no adapter for family {family.value!r}; supported: {supported()}")


def read_family_traits(folder: str | pathlib.Path) -> FamilyTraits:
    """The folder's family and request features, from its json files (no weights)."""
    root = pathlib.Path(folder)
    index = read_json(root / "model_index.json")
    for adapter in adapters():
        if adapter.recognises(index):
            why = adapter.unsupported_variant(index, root)
            if why is not None:
                raise UnsupportedModelFolder(f"{root}: {why}; supported families: {supported()}")
            facts = adapter.facts(root, index)
            missing = [name for name in facts.requirements if importlib.util.find_spec(name) is None]
            if missing:
                raise UnsupportedModelFolder(f"{root}: the {facts.family.value} pipeline needs the Python "
                                             f"package(s) {missing}, not installed (pip install {' '.join(missing)})")
            return dataclasses.replace(facts, shift_terminal=_shift_terminal(root))
    raise UnsupportedModelFolder(f"{root}: pipeline {index.get('_class_name')!r} has no adapter; supported "
                                 f"families: {supported()}")


def _shift_terminal(root: pathlib.Path) -> float | None:
    """The scheduler's ``shift_terminal`` (a flow-match scheduler's; None where unset or no scheduler)."""
    path = root / "scheduler" / "scheduler_config.json"
    value = read_json(path).get("shift_terminal") if path.is_file() else None
    return None if value is None else float(value)


# The weights file each library's from_pretrained(use_safetensors=True) reads, without a variant.
WEIGHTS_NAME = {"diffusers": "diffusion_pytorch_model", "transformers": "model"}


def check_weights(facts: FamilyTraits) -> None:
    """Raise :class:`UnsupportedModelFolder` unless every component the stages load has the safetensors
    file (or every shard its index names) that its ``from_pretrained`` reads: a partial download,
    variant-only weights (``*.fp16.safetensors``) or pickle-only ones (``*.bin``) would otherwise fail each
    replica's start, minutes later."""
    root = pathlib.Path(facts.folder)
    index = read_json(root / "model_index.json")
    adapter = adapter_for(facts)
    names = sorted({n for stage in PipelineStage for n in adapter.modules(facts, stage)})
    faults = [fault for name in names if isinstance(index.get(name), list) and index[name][0] in WEIGHTS_NAME
              for fault in [_weights_fault(root / name, WEIGHTS_NAME[index[name][0]])] if fault]
    if faults:
        raise UnsupportedModelFolder(f"{root}: {'; '.join(faults)} (this service loads only safetensors, "
                                     "without a variant)")


def _weights_fault(folder: pathlib.Path, stem: str) -> str | None:
    single, sharded = folder / f"{stem}.safetensors", folder / f"{stem}.safetensors.index.json"
    if single.is_file():
        return None
    if sharded.is_file():
        shards = sorted(set(read_json(sharded).get("weight_map", {}).values()))
        missing = [s for s in shards if not (folder / s).is_file()]
        if missing:
            return (f"{folder.name}: {len(missing)} of the {len(shards)} shards {sharded.name} names are missing "
                    f"({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}): an interrupted download?")
        return None
    present = sorted(p.name for p in folder.glob("*") if p.suffix in (".safetensors", ".bin", ".pt", ".ckpt"))
    found = f"it holds {', '.join(present[:3])}" if present else "it holds no weights file"
    return f"{folder.name}: no {single.name} nor {sharded.name}; {found}"
