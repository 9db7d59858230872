"""Real-size components as module skeletons: their tree of modules and tensor shapes, without their library.

Planning reads a module's tree (names, the torch module types, its class name) and its tensors'
shapes, strides and dtypes; nothing else. Building the real class on ``meta`` needs diffusers or
transformers, and importing either pulls in ``torch._dynamo`` (diffusers.utils.torch_utils
imports it at module level; transformers' masking utils too) and ``torch.distributed.tensor``:
3-4 s of CPU the first time a model is planned on a machine (bench/plan_speed.py), against a
target of 1 s beyond torch's import for the whole plan. So the shapes of every component in
configs/models/real_model_configs.json, as the pinned library versions build them, are written
once to ``configs/models/real_model_skeletons.json`` (``python -m offload_core.planner.skeletons``),
and a plan rebuilds a component from there: torch.nn containers and layers as themselves (so the
engine's type tests, nn.Linear for FP8 and nn.Embedding for host tables, see them), the library's
classes as empty nn.Module subclasses of the same name and base-class names, tied tensors and
modules tied again.

A skeleton is used only when it was written by the library versions installed now (else the
component is built from its library, as before): a stale file costs time, never a wrong plan.
tests/offload_core/planner/test_skeletons.py checks that every committed skeleton profiles exactly
like the library-built module. Runs in whichever process plans (the CLI, a stage replica).
"""
from __future__ import annotations

import argparse
import functools
import hashlib
import importlib.metadata
import json
import os
from pathlib import Path
from typing import Any, Mapping

import torch
from torch import nn

from compat.torch import non_persistent_buffers, own_buffers, own_children, own_parameters
from offload_core.planner import real_models

SKELETON_PATH = real_models.CONFIG_PATH.with_name("real_model_skeletons.json")
# The libraries whose classes the skeletons describe: another version may build other shapes.
LIBRARIES = ("diffusers", "transformers")
_TORCH_PREFIX = "torch.nn.modules."


def component_key(class_name: str, config: Mapping[str, Any], dtype: torch.dtype) -> str:
    """What a skeleton is filed under: the class, its full config and the dtype it is cast to."""
    what = json.dumps({"class": class_name, "config": dict(config), "dtype": str(dtype)}, sort_keys=True, default=str)
    return hashlib.sha256(what.encode()).hexdigest()[:32]


def library_versions() -> dict[str, str]:
    """The installed versions of :data:`LIBRARIES` (read from their metadata: imports neither)."""
    versions = {}
    for library in LIBRARIES:
        try:
            versions[library] = importlib.metadata.version(library)
        except importlib.metadata.PackageNotFoundError:
            versions[library] = "absent"
    return versions


# ---- writing: a built module to its skeleton -------------------------------------------------

def _type_entry(module: nn.Module) -> list[str]:
    """A torch.nn type by its qualified name; a library class by its name and its bases' names, down to
    nn.Module or to the torch.nn class it derives from (diffusers' FP32LayerNorm is an nn.LayerNorm)."""
    chain = []
    for base in type(module).__mro__:
        if base is nn.Module:
            return chain
        if base.__module__.startswith(_TORCH_PREFIX):
            return [*chain, f"{base.__module__}.{base.__qualname__}"]
        if issubclass(base, nn.Module):
            chain.append(base.__name__)
    raise ValueError(f"{type(module).__name__} is not an nn.Module")


def _tensor_entry(kind: str, name: str, tensor: torch.Tensor, persistent: bool) -> list[Any]:
    return [kind, name, list(tensor.shape), list(tensor.stride()), tensor.storage_offset(), str(tensor.dtype),
            bool(getattr(tensor, "requires_grad", False)), persistent]


def skeleton_of(model: nn.Module) -> dict[str, Any]:
    """``model``'s skeleton: one entry per distinct module shape (40 identical blocks share one) and its ties."""
    shapes: dict[str, int] = {}
    table: list[Any] = []
    first_tensor: dict[int, str] = {}
    first_module: dict[int, str] = {}
    ties: list[list[str]] = []

    def visit(module: nn.Module, path: str) -> int:
        for bad in ("tp_size",):
            if getattr(module, bad, None) not in (None, 1):
                raise ValueError(f"{path or 'the root'}: {bad}={getattr(module, bad)}: skeletons are of unsharded modules")
        first_module.setdefault(id(module), path)
        tensors, children = [], []
        for kind, registry in (("p", own_parameters(module)), ("b", own_buffers(module))):
            for name, tensor in registry.items():
                full = f"{path}.{name}" if path else name
                if tensor is not None and id(tensor) in first_tensor:
                    ties.append(["tensor", full, first_tensor[id(tensor)]])
                elif tensor is not None:
                    first_tensor[id(tensor)] = full
                persistent = name not in non_persistent_buffers(module)
                tensors.append([kind, name, None] if tensor is None else _tensor_entry(kind, name, tensor, persistent))
        for name, child in own_children(module).items():
            full = f"{path}.{name}" if path else name
            if child is not None and first_module.get(id(child), full) != full:
                ties.append(["module", full, first_module[id(child)]])
                children.append([name, None, True])
                continue
            children.append([name, None if child is None else visit(child, full), False])
        entry = [_type_entry(module), tensors, children]
        text = json.dumps(entry)
        if text not in shapes:
            shapes[text] = len(table)
            table.append(entry)
        return shapes[text]

    root = visit(model, "")
    return {"class": type(model).__name__, "root": root, "modules": table, "ties": ties}


# ---- reading: a skeleton to a module on meta --------------------------------------------------

@functools.lru_cache(maxsize=None)
def _stand_in(chain: tuple[str, ...]) -> type:
    """The class a type entry names: a torch.nn class itself; a library class as an empty subclass named
    ``chain[0]`` of stand-ins named like the rest of ``chain``, on top of its torch.nn class or nn.Module."""
    if chain[0].startswith(_TORCH_PREFIX):
        return _torch_type(chain[0])
    base = nn.Module if len(chain) == 1 else _stand_in(chain[1:])
    return type(chain[0], (base,), {"__module__": __name__, "__doc__": "A planning skeleton's stand-in."})


@functools.lru_cache(maxsize=None)
def _torch_type(qualified: str) -> type:
    module_name, _, name = qualified.rpartition(".")
    cls = getattr(__import__(module_name, fromlist=[name]), name)
    assert isinstance(cls, type) and issubclass(cls, nn.Module), qualified
    return cls


def _new_module(type_entry: list[str]) -> nn.Module:
    cls = _stand_in(tuple(type_entry))
    module = cls.__new__(cls)
    nn.Module.__init__(module)  # the tree and the tensors are all a plan reads; the class's own fields are not set
    return module


def _meta_tensor(entry: list[Any]) -> torch.Tensor:
    kind, _, shape, stride, offset, dtype_name, requires_grad, _ = entry
    dtype = getattr(torch, dtype_name.removeprefix("torch."))
    extent = 1 + sum((size - 1) * step for size, step in zip(shape, stride)) if all(shape) else 0
    tensor = torch.empty(offset + extent, dtype=dtype, device="meta").as_strided(shape, stride, offset)
    return nn.Parameter(tensor, requires_grad=requires_grad) if kind == "p" else tensor


def _build(skeleton: Mapping[str, Any], index: int) -> nn.Module:
    type_entry, tensors, children = skeleton["modules"][index]
    module = _new_module(type_entry)
    for entry in tensors:
        kind, name = entry[0], entry[1]
        registry = own_parameters(module) if kind == "p" else own_buffers(module)
        registry[name] = None if entry[2] is None else _meta_tensor(entry)
        if kind == "b" and entry[2] is not None and not entry[7]:
            non_persistent_buffers(module).add(name)
    for name, child, tied in children:
        # A tied module is filled in after the tree exists; the slot keeps its place in the order.
        own_children(module)[name] = None if child is None or tied else _build(skeleton, child)
    return module


def module_from(skeleton: Mapping[str, Any]) -> nn.Module:
    """The module a skeleton describes, on meta (allocates nothing), in eval mode."""
    root = _build(skeleton, skeleton["root"])
    for kind, path, target in skeleton["ties"]:
        owner_path, _, name = path.rpartition(".")
        owner = root.get_submodule(owner_path)
        if kind == "module":
            own_children(owner)[name] = root.get_submodule(target)
            continue
        target_owner, _, target_name = target.rpartition(".")
        holder = root.get_submodule(target_owner)
        source = own_parameters(holder) if target_name in own_parameters(holder) else own_buffers(holder)
        (own_parameters(owner) if name in own_parameters(owner) else own_buffers(owner))[name] = source[target_name]
    return root.eval()


@functools.lru_cache(maxsize=1)
def _committed() -> dict[str, Any]:
    if not SKELETON_PATH.is_file():
        return {"libraries": {}, "components": {}}
    with open(SKELETON_PATH) as f:
        return json.load(f)


def skeleton_module(class_name: str, config: Mapping[str, Any], dtype: torch.dtype) -> nn.Module | None:
    """The committed skeleton of this component as a module on meta, or None when there is none for the
    installed library versions (the caller then builds the class itself)."""
    if os.environ.get("OFFLOAD_SERVE_PLAN_SKELETONS", "1") == "0":  # bench/plan_speed.py's library baseline
        return None
    committed = _committed()
    if committed["libraries"] != library_versions():
        return None
    skeleton = committed["components"].get(component_key(class_name, config, dtype))
    if skeleton is None or skeleton["class"] != class_name:
        return None
    return module_from(skeleton)


def write(path: Path = SKELETON_PATH) -> int:
    """Build every component of every model in the real-model config with its library and write the
    skeletons; returns how many distinct components were written."""
    components: dict[str, Any] = {}
    for model_name in real_models.model_names():
        for component in real_models.component_names(model_name):
            spec = real_models.component_spec(model_name, component)
            key = component_key(spec.class_name, spec.config, spec.dtype)
            if key not in components:
                components[key] = skeleton_of(real_models.build_meta(spec.class_name, spec.config, spec.dtype))
    # One line per component: a library upgrade's diff shows which components changed.
    lines = [f" {json.dumps(key)}: {json.dumps(components[key], separators=(',', ':'))}" for key in sorted(components)]
    path.write_text(f'{{"libraries": {json.dumps(library_versions(), sort_keys=True)},\n"components": {{\n'
                    + ",\n".join(lines) + "\n}}\n")
    _committed.cache_clear()
    return len(components)


def main() -> None:
    parser = argparse.ArgumentParser(description="Write configs/models/real_model_skeletons.json from the "
                                     "installed diffusers and transformers (after upgrading either).")
    parser.parse_args()
    count = write()
    print(f"wrote {count} component skeletons to {SKELETON_PATH} ({SKELETON_PATH.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
