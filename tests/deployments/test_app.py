"""build_app validates its args and wires the four deployments, without Ray running."""
from __future__ import annotations

import pytest
from pydantic import ValidationError
from ray.serve import Application

from deployments.app import AppArgs, build_app, resolve_model_folder, stage_configs
from deployments.families import read_family_facts
from deployments.spec import PipelineStage
from offload_core.planner.search import PerformanceMode

ENCODE, DENOISE, DECODE = PipelineStage.ENCODE, PipelineStage.DENOISE, PipelineStage.DECODE


def test_each_stage_is_configured_with_its_mode_and_uses_per_request():
    args = AppArgs.model_validate({"tiny_family": "wan", "denoiser": {"offload_mode": "memory"}})
    configs = stage_configs(args, read_family_facts(resolve_model_folder(args)))
    assert {s: c.mode for s, c in configs.items()} == {
        ENCODE: PerformanceMode.AUTO, DENOISE: PerformanceMode.MEMORY, DECODE: PerformanceMode.AUTO}
    # 20 default steps x 2 guidance passes: what the planner weighs the denoiser's bytes by
    assert dict(configs[DENOISE].uses_per_request) == {"transformer": 40}
    assert dict(configs[ENCODE].uses_per_request) == {"text_encoder": 2}
    assert isinstance(build_app(args), Application)


def test_unknown_args_and_modes_are_refused_by_name():
    with pytest.raises(ValidationError, match="model_pth"):
        AppArgs.model_validate({"model_pth": "/models/x"})
    with pytest.raises(ValidationError, match="offload_mode"):
        AppArgs.model_validate({"denoiser": {"offload_mode": "turbo"}})


def test_a_configured_but_unset_token_variable_refuses_to_start(monkeypatch):
    monkeypatch.delenv("OFFLOAD_SERVE_NO_SUCH_TOKEN", raising=False)
    with pytest.raises(ValueError, match="OFFLOAD_SERVE_NO_SUCH_TOKEN"):
        build_app(AppArgs(api_token_env="OFFLOAD_SERVE_NO_SUCH_TOKEN"))


def test_a_folder_that_is_not_a_supported_pipeline_is_refused_at_build(tmp_path):
    from deployments.families import UnsupportedModelFolder

    with pytest.raises(UnsupportedModelFolder):
        build_app(AppArgs(model_path=str(tmp_path)))
