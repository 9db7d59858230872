"""build_app's LoRA adapters: listed per model, checked before any replica starts, handed to the
Denoiser (with its device budget) and to the ingress (names and scales only); without Ray."""
from __future__ import annotations

import re

import pytest
from pydantic import ValidationError

from deployments.app import AppArgs, build_app, resolve_model_folder, stage_configs
from deployments.models.families import read_family_traits
from deployments.wire.spec import PipelineStage


def _adapter_file(tmp_path, name="ink.safetensors"):
    path = tmp_path / name
    path.write_bytes(b"placeholder: build_app checks it exists; the Denoiser reads it")
    return path


def _args(**overrides) -> AppArgs:
    return AppArgs.model_validate({"tiny_family": "wan", **overrides})


def test_adapters_reach_the_denoiser_with_their_budget_and_the_ingress_by_name(tmp_path):
    folder = tmp_path / "neon"
    folder.mkdir()
    _adapter_file(folder, "pytorch_lora_weights.safetensors")
    args = _args(lora_adapters=[{"name": "ink", "path": str(_adapter_file(tmp_path)), "scale": 0.7,
                                 "families": ["wan"]},
                                {"name": "neon", "path": str(folder), "families": ["flux", "wan"]}],
                 lora_device_budget="64MiB")
    configs = stage_configs(args, read_family_traits(resolve_model_folder(args)))
    denoiser = configs[PipelineStage.DENOISE]
    assert [(lora.name, lora.scale) for lora in denoiser.loras] == [("ink", 0.7), ("neon", 1.0)]
    assert denoiser.loras[1].path == str(folder.resolve()) and denoiser.lora_device_budget == 64 << 20
    assert configs[PipelineStage.ENCODE].loras == () == configs[PipelineStage.DECODE].loras
    *_, ingress = build_app(args)._bound_deployment.init_args
    assert ingress.loras == denoiser.loras


@pytest.mark.parametrize("adapter, message", [
    ({"families": ["flux"]}, "fits ['flux'], not the served wan model"),
    ({"path": "/nowhere/ink.safetensors"}, "neither a .safetensors file nor a folder"),
    ({"path": "__pickle__"}, "neither a .safetensors file nor a folder"),
])
def test_an_adapter_for_another_family_or_without_a_safetensors_file_fails_the_build(tmp_path, adapter, message):
    path = tmp_path / "ink.bin"
    path.write_bytes(b"a pickle is never loaded")
    entry = {"name": "ink", "path": str(_adapter_file(tmp_path)), "families": ["wan"], **adapter}
    if entry["path"] == "__pickle__":
        entry["path"] = str(path)
    with pytest.raises(ValueError, match=re.escape(message)):
        build_app(_args(lora_adapters=[entry]))


def test_adapter_names_are_unique_and_well_formed_and_the_budget_is_a_size(tmp_path):
    path = str(_adapter_file(tmp_path))
    with pytest.raises(ValueError, match="names must be unique"):
        build_app(_args(lora_adapters=[{"name": "ink", "path": path, "families": ["wan"]}] * 2))
    with pytest.raises(ValidationError, match="name"):
        _args(lora_adapters=[{"name": "../ink", "path": path, "families": ["wan"]}])
    with pytest.raises(ValidationError, match="families"):
        _args(lora_adapters=[{"name": "ink", "path": path, "families": ["sdxl"]}])
    with pytest.raises(ValidationError, match="lora_device_budget"):
        _args(lora_device_budget=0.5)
    with pytest.raises(ValidationError, match="lora_device_budget"):
        _args(lora_device_budget="lots")
