"""Which adapter serves a folder: every module of ``deployments.models`` that defines ``ADAPTERS``.

Adding a family adds its module; nothing here changes. A folder no adapter recognises, or a
variant its adapter does not handle, is :class:`UnsupportedModelFolder` naming the supported
families (``build_app`` fails with it, so a deploy never comes up answering 404 to everything).
Run wherever a folder's family is asked: the ingress, the stage replicas, the planner CLI's callers.
"""
from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import pathlib
import pkgutil
from functools import lru_cache

from deployments.models.adapter import FamilyAdapter, FamilyTraits, UnsupportedModelFolder, read_json
from deployments.wire.spec import Family


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
