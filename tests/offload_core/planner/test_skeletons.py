"""Committed module skeletons: a real component plans exactly as its library builds it, without the library."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from offload_core.planner import real_models, skeletons
from offload_core.planner.facts import profile_component, streamable_groups
from offload_core.planner.inputs import GiB, gpu_spec, real_model_facts
from offload_core.quant import WeightFormat
from offload_core.tables import HostTablesConfig

REPO = Path(__file__).resolve().parents[3]


def _specs() -> dict[str, real_models.ComponentSpec]:
    """Every distinct component of the real-model config, by skeleton key."""
    specs = {}
    for model_name in real_models.model_names():
        for component in real_models.component_names(model_name):
            spec = real_models.component_spec(model_name, component)
            specs.setdefault(skeletons.component_key(spec.class_name, spec.config, spec.dtype), spec)
    return specs


def _lineage(cls: type) -> list[str]:
    """The class's name and its bases' down to the first torch.nn class (mixins after it are not read)."""
    names = []
    for base in cls.__mro__:
        names.append(base.__name__ if not base.__module__.startswith("torch.nn.") else f"torch:{base.__qualname__}")
        if base.__module__.startswith("torch.nn."):
            return names
    raise AssertionError(f"{cls} is not an nn.Module")


def _structure(module: nn.Module) -> list[tuple]:
    """What a plan can read of a module: its tree, each module's class (by name, with its bases') and tensors."""
    rows = []
    for path, mod in module.named_modules(remove_duplicate=False):
        rows.append((path, _lineage(type(mod))))
        for name, t in [*mod._parameters.items(), *mod._buffers.items()]:
            rows.append((path, name, None if t is None else (tuple(t.shape), t.stride(), t.storage_offset(), t.dtype,
                                                                 isinstance(t, nn.Parameter), t.device.type)))
    return rows


@pytest.mark.parametrize("spec", sorted(_specs().values(), key=lambda s: (s.model_name, s.component)),
                         ids=lambda s: f"{s.model_name}/{s.component}")
def test_each_committed_skeleton_profiles_exactly_like_its_library_build(spec):
    skeleton = skeletons.skeleton_module(spec.class_name, spec.config, spec.dtype)
    assert skeleton is not None, (f"{spec.model_name}/{spec.component} has no skeleton for the installed libraries: "
                                  "run .venv/bin/python -m offload_core.planner.skeletons")
    built = real_models.build_meta(spec.class_name, spec.config, spec.dtype)
    assert _structure(skeleton) == _structure(built)
    groups = streamable_groups(built, spec.layer_groups or None)
    assert streamable_groups(skeleton, spec.layer_groups or None) == groups
    # FP8 reads the torch.nn types (nn.Linear, nn.Conv*) of every layer; the table rule nn.Embedding and ties.
    for weights, tables in ((WeightFormat.NATIVE, HostTablesConfig()), (WeightFormat.FP8, HostTablesConfig(min_bytes=0))):
        assert (profile_component(spec.component, skeleton, uses_per_request=3, layer_groups=groups,
                                  tables=tables, weights=weights)
                == profile_component(spec.component, built, uses_per_request=3, layer_groups=groups,
                                     tables=tables, weights=weights)), (weights, tables)


def test_tied_tables_stay_one_tensor_in_the_skeleton():
    spec = real_models.component_spec("wan2.1-t2v-14b", "text_encoder")
    umt5 = skeletons.skeleton_module(spec.class_name, spec.config, spec.dtype)
    assert umt5.shared.weight is umt5.encoder.embed_tokens.weight
    assert isinstance(umt5.shared, nn.Embedding) and type(umt5).__name__ == "UMT5EncoderModel"
    assert all(t.device.type == "meta" for t in umt5.state_dict().values())


def test_skeletons_of_other_library_versions_are_not_used(monkeypatch):
    monkeypatch.setenv("OFFLOAD_SERVE_PLAN_CACHE", "0")
    gpu = gpu_spec("L4")
    from_skeletons, notes = real_model_facts("wan2.1-t2v-1.3b", gpu, 64 * GiB)
    monkeypatch.setattr(skeletons, "library_versions", lambda: {"diffusers": "0.0.1", "transformers": "0.0.1"})
    spec = real_models.component_spec("wan2.1-t2v-1.3b", "transformer")
    assert skeletons.skeleton_module(spec.class_name, spec.config, spec.dtype) is None
    built, built_notes = real_model_facts("wan2.1-t2v-1.3b", gpu, 64 * GiB)
    assert built.components == from_skeletons.components and built_notes == notes


def test_a_first_plan_of_wan_imports_no_model_library_nor_dynamo_nor_dtensor(tmp_path):
    """The first plan on a machine (no profile cache) pays torch's import and little else."""
    code = ("import sys, json\n"
            "from offload_core.planner.inputs import GiB, gpu_spec, real_model_facts\n"
            "facts, _ = real_model_facts('wan2.1-t2v-14b', gpu_spec('L4'), 64 * GiB)\n"
            "heavy = sorted(m for m in ('diffusers', 'transformers', 'torch._dynamo', 'torch.distributed.tensor')\n"
            "               if m in sys.modules)\n"
            "print(json.dumps({'heavy': heavy, 'components': [c.name for c in facts.components]}))\n")
    env = {"OFFLOAD_SERVE_PLAN_CACHE": "0", "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin",
           "HOME": str(tmp_path), "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out == {"heavy": [], "components": ["text_encoder", "transformer", "vae"]}


def test_a_dtype_cast_or_config_change_is_another_skeleton():
    base = ("WanTransformer3DModel", {"num_layers": 30}, torch.bfloat16)
    key = skeletons.component_key(*base)
    assert skeletons.component_key("WanTransformer3DModel", {"num_layers": 40}, torch.bfloat16) != key
    assert skeletons.component_key("WanTransformer3DModel", {"num_layers": 30}, torch.float32) != key
