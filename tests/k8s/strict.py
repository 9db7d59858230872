"""Strict validators for the manifests: the CRD's openAPIV3Schema and Ray Serve's pydantic schema.

Both sources tolerate unknown keys (the API server prunes them; Serve's top-level schema allows
extras for forward compatibility), so a typo like `minReplica` or `max_ongoing_request` would be
silently dropped in production. Here an unknown key is an error.
"""
from __future__ import annotations

import copy
import re
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


# Kubernetes name syntax (k8s.io/apimachinery/pkg/util/validation), as KubeRay's webhook checks it.
_DNS1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_DNS1123_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_LABEL_NAME = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")
_DNS1123_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")


def _qualified_name(key: str) -> bool:
    prefix, _, name = key.rpartition("/")
    if prefix and (len(prefix) > 253 or not _DNS1123_SUBDOMAIN.match(prefix)):
        return False
    return len(name) <= 63 and bool(_LABEL_NAME.match(name))


def kuberay_rule_errors(name: str, cluster: dict) -> list[str]:
    """The operator-side checks of KubeRay's ValidateRayClusterSpec that a CRD schema cannot express.

    Mirrors ray-operator/controllers/ray/utils/validation.go: DNS-1035 cluster name (<= 63 chars
    here; KubeRay appends suffixes), no `labels` in rayStartParams (the top-level field only),
    resources in rayStartParams or the structured field but not both, valid label syntax,
    minReplicas <= maxReplicas, and group names that are valid pod label values.
    """
    errors = []
    if len(name) > 63 or not _DNS1035.match(name):
        errors.append(f"metadata.name {name!r} is not a DNS-1035 label")
    groups = [("Head", cluster["headGroupSpec"])] + [(g.get("groupName", "?"), g) for g in cluster.get("workerGroupSpecs", [])]
    for group_name, group in groups:
        start = group.get("rayStartParams", {})
        if "labels" in start:
            errors.append(f"{group_name}: rayStartParams['labels'] is not supported; use the top-level labels field")
        if any(start.get(k) for k in ("num-cpus", "num-gpus", "memory", "resources")) and group.get("resources"):
            errors.append(f"{group_name}: resources set in both rayStartParams and resources")
        for key, value in group.get("labels", {}).items():
            if not _qualified_name(key):
                errors.append(f"{group_name}: invalid label key {key!r}")
            if value and (len(value) > 63 or not _LABEL_NAME.match(value)):
                errors.append(f"{group_name}: invalid label value {value!r} for {key!r}")
        if group_name != "Head":
            if not _DNS1123_LABEL.match(group_name):
                errors.append(f"group name {group_name!r} is not a valid label value / DNS-1123 label")
            if group.get("minReplicas", 0) > group.get("maxReplicas", 2**31):
                errors.append(f"{group_name}: minReplicas > maxReplicas")
        if not group["template"]["spec"].get("containers"):
            errors.append(f"{group_name}: no container")
    return errors
