"""Strict validators for the manifests: the CRD's openAPIV3Schema and Ray Serve's pydantic schema.

Both sources tolerate unknown keys (the API server prunes them; Serve's top-level schema allows
extras for forward compatibility), so a typo like `minReplica` or `max_ongoing_request` would be
silently dropped in production. Here an unknown key is an error.
"""
from __future__ import annotations

import copy
import types
import typing
from pathlib import Path

import jsonschema
import yaml
from pydantic import BaseModel

CRD_DIR = Path(__file__).resolve().parents[2] / "k8s" / "crds"


def crd_schema(crd_file: str, version: str = "v1") -> dict:
    """The openAPIV3Schema of one served version of a CRD file in k8s/crds/."""
    # libyaml's loader: the pure-Python one takes ~10 s on an 18k-line CRD on a busy 2-core box.
    crd = yaml.load((CRD_DIR / crd_file).read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    for entry in crd["spec"]["versions"]:
        if entry["name"] == version:
            return entry["schema"]["openAPIV3Schema"]
    raise KeyError(f"{crd_file} has no version {version!r}")


def closed(schema: dict) -> dict:
    """A copy of ``schema`` where every object with declared properties rejects unknown keys.

    Objects marked x-kubernetes-preserve-unknown-fields, or with their own additionalProperties
    (maps such as rayStartParams or resource limits), keep their declared behaviour.
    """
    schema = copy.deepcopy(schema)

    def visit(node):
        if isinstance(node, dict):
            if ("properties" in node and "additionalProperties" not in node
                    and not node.get("x-kubernetes-preserve-unknown-fields")):
                node["additionalProperties"] = False
            for value in node.values():
                visit(value)
        elif isinstance(node, list):
            for value in node:
                visit(value)

    visit(schema)
    return schema


def crd_errors(document: dict, schema: dict) -> list[str]:
    """Every violation of a closed CRD schema, as 'path: message' lines."""
    validator = jsonschema.Draft7Validator(schema)
    return [f"{'/'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}"
            for e in sorted(validator.iter_errors(document), key=lambda e: list(map(str, e.path)))]


def _unwrap(annotation):
    """Strip Optional/Annotated; return (origin, args) of what is left."""
    while typing.get_origin(annotation) is typing.Annotated:
        annotation = typing.get_args(annotation)[0]
    return typing.get_origin(annotation), typing.get_args(annotation), annotation


def _is_model(annotation) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def unknown_keys(value, annotation, path: str = "") -> list[str]:
    """Paths of keys in ``value`` that no pydantic model on the way declares (name or alias).

    Walks models, lists, dicts and unions (a dict value in a ``Union[Dict, Model]`` position is
    checked against the model: Serve accepts either, but a typo'd dict would be dropped later).
    Free-form dicts (user_config, args, resources) are not descended into.
    """
    origin, args, bare = _unwrap(annotation)
    if _is_model(bare):
        if not isinstance(value, dict):
            return []
        fields = bare.model_fields
        names = {n: f for n, f in fields.items()} | {f.alias: f for f in fields.values() if f.alias}
        found = []
        for key, item in value.items():
            if key not in names:
                found.append(f"{path}.{key}" if path else key)
            else:
                found += unknown_keys(item, names[key].annotation, f"{path}.{key}" if path else key)
        return found
    if origin in (typing.Union, types.UnionType):
        models = [a for a in args if _is_model(_unwrap(a)[2])]
        if isinstance(value, dict) and models:
            return unknown_keys(value, models[0], path)
        lists = [a for a in args if _unwrap(a)[0] is list]
        if isinstance(value, list) and lists:
            return unknown_keys(value, lists[0], path)
        return []
    if origin is list and isinstance(value, list) and args:
        return [k for i, item in enumerate(value) for k in unknown_keys(item, args[0], f"{path}[{i}]")]
    if origin is dict and isinstance(value, dict) and len(args) == 2:
        return [k for key, item in value.items() for k in unknown_keys(item, args[1], f"{path}.{key}")]
    return []
