"""build_app validates its args and wires the four deployments, without Ray running."""
from __future__ import annotations

import pytest
from pydantic import ValidationError

from deployments.app import AppArgs, StageArgs, build_app, resolve_model_folder, stage_configs
from deployments.capacity.request_limits import Limits
from deployments.ingress.deployment import IngressConfig
from deployments.models.families import read_family_traits
from deployments.wire.spec import PipelineStage
from offload_core.compile.buckets import RequestShape
from offload_core.planner.search import PerformanceMode
from zoo import tiny_families

ENCODE, DENOISE, DECODE = PipelineStage.ENCODE, PipelineStage.DENOISE, PipelineStage.DECODE


def test_each_stage_is_configured_with_its_mode_and_uses_per_request():
    args = AppArgs.model_validate({"tiny_family": "wan", "denoiser": {"offload_mode": "memory"}})
    configs = stage_configs(args, read_family_traits(resolve_model_folder(args)))
    # Left open: each replica takes the fleet profile's mode for the GPU it gets.
    assert {s: c.mode for s, c in configs.items()} == {ENCODE: None, DENOISE: PerformanceMode.MEMORY, DECODE: None}
    # 20 default steps, guidance's two branches in one forward (step batching): what the planner
    # weighs the denoiser's bytes by; the encoder still runs twice.
    assert dict(configs[DENOISE].uses_per_request) == {"transformer": 20}
    assert dict(configs[ENCODE].uses_per_request) == {"text_encoder": 2}


def test_the_ingress_is_bound_to_the_three_stages_with_their_configs_and_serve_options(monkeypatch):
    monkeypatch.setenv("OFFLOAD_SERVE_WIRING_TOKEN", "s3cret")
    args = AppArgs.model_validate({
        "app_name": "wired", "model_id": "my-model", "decoder": {"offload_mode": "balanced"},
        "limits": {"max_steps": 30}, "api_token_env": "OFFLOAD_SERVE_WIRING_TOKEN", "retry_after_s": 3,
        "replica_num_cpus": 0.5, "stage_max_queued_requests": 5, "ingress_max_ongoing_requests": 9})
    ingress = build_app(args)._bound_deployment  # Serve keeps the bound graph here, unbuilt
    assert (ingress.name, ingress.ray_actor_options, ingress.max_ongoing_requests) == ("Ingress", {"num_cpus": 0.5}, 9)
    *stages, config = ingress.init_args
    facts = read_family_traits(resolve_model_folder(args))
    assert config == IngressConfig("wired", "my-model", facts, Limits(max_steps=30), "s3cret", 3)
    expected = stage_configs(args, facts)
    bound = [stage._bound_deployment for stage in stages]
    assert [(d.name, d.init_args) for d in bound] == [
        ("TextEncoder", (expected[ENCODE],)), ("Denoiser", (expected[DENOISE],)), ("VaeDecoder", (expected[DECODE],))]
    assert expected[DECODE].mode is PerformanceMode.BALANCED and expected[DECODE].app_name == "wired"
    # One call at a time per encoder/decoder replica (its pipeline is not reentrant); the Denoiser
    # holds a batch's worth (step batching); the rest queue, then 503.
    assert [(d.ray_actor_options["num_cpus"], d.max_ongoing_requests, d.max_queued_requests) for d in bound] == [
        (0.5, 1, 5), (0.5, args.batching.max_batch, 5), (0.5, 1, 5)]
    assert expected[DENOISE].batching == args.batching.config() and expected[ENCODE].batching is None
    # Stage replicas at niceness 0 (Ray starts its workers at 15); the ingress keeps Ray's.
    assert [d.ray_actor_options["runtime_env"] for d in bound] == [{"env_vars": {"RAY_worker_niceness": "0"}}] * 3
    unset = build_app(args.model_copy(update={"replica_niceness": None}))._bound_deployment.init_args[:3]
    assert all("runtime_env" not in s._bound_deployment.ray_actor_options for s in unset)


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
    from deployments.models.families import UnsupportedModelFolder

    with pytest.raises(UnsupportedModelFolder):
        build_app(AppArgs(model_path=str(tmp_path)))


def test_a_host_memory_budget_is_parsed_per_stage_at_build_and_a_typo_is_refused_there():
    args = AppArgs.model_validate({"denoiser": {"offload_mode": "memory", "host_memory_budget": "16GiB"},
                                   "encoder": {"host_memory_budget": 0.25}})
    configs = stage_configs(args, read_family_traits(resolve_model_folder(args)))
    assert configs[DENOISE].host_budget.nbytes == 16 * 1024**3
    assert configs[ENCODE].host_budget.fraction == 0.25 and configs[DECODE].host_budget is None
    with pytest.raises(ValidationError, match="host_memory_budget .*16 parsecs.* is not a size"):
        AppArgs.model_validate({"denoiser": {"host_memory_budget": "16 parsecs"}})
    with pytest.raises(ValidationError, match=r"\(0, 1\]"):
        AppArgs.model_validate({"decoder": {"host_memory_budget": 2.5}})


def test_weights_are_set_per_stage_native_by_default_and_a_typo_is_refused_by_name():
    from offload_core.quant import WeightFormat

    args = AppArgs.model_validate({"denoiser": {"weights": "fp8"}})
    configs = stage_configs(args, read_family_traits(resolve_model_folder(args)))
    assert configs[DENOISE].weights is WeightFormat.FP8
    assert configs[ENCODE].weights is WeightFormat.NATIVE is configs[DECODE].weights
    with pytest.raises(ValidationError, match="weights"):
        AppArgs.model_validate({"denoiser": {"weights": "int4"}})


def test_the_step_cache_threshold_is_the_denoisers_and_is_refused_on_other_stages():
    args = AppArgs.model_validate({"denoiser": {"cache_threshold": 0.1}})
    configs = stage_configs(args, read_family_traits(resolve_model_folder(args)))
    assert configs[DENOISE].cache_threshold == 0.1 and configs[ENCODE].cache_threshold == 0.0
    with pytest.raises(ValueError, match="encode: cache_threshold is the denoiser's step cache"):
        args = AppArgs.model_validate({"encoder": {"cache_threshold": 0.1}})
        stage_configs(args, read_family_traits(resolve_model_folder(args)))
    with pytest.raises(ValidationError, match="cache_threshold"):
        AppArgs.model_validate({"denoiser": {"cache_threshold": 1.5}})


def test_vae_tiling_is_the_decoders_auto_follows_the_family_and_a_tile_is_a_multiple_of_64():
    wan = AppArgs.model_validate({})
    configs = stage_configs(wan, read_family_traits(resolve_model_folder(wan)))
    assert not configs[DECODE].vae_tiling, "auto: Wan's published usage decodes untiled"
    on = AppArgs.model_validate({"decoder": {"vae_tiling": "on", "vae_tile_px": 128}})
    configs = stage_configs(on, read_family_traits(resolve_model_folder(on)))
    assert (configs[DECODE].vae_tiling, configs[DECODE].vae_tile_px) == (True, 128)
    assert not configs[ENCODE].vae_tiling and not configs[DENOISE].vae_tiling
    hunyuan = AppArgs.model_validate({"model_path": str(tiny_families.ensure_tiny_hunyuan15())})
    assert stage_configs(hunyuan, read_family_traits(resolve_model_folder(hunyuan)))[DECODE].vae_tiling, (
        "auto: HunyuanVideo 1.5 tiles, as diffusers' examples do")
    with pytest.raises(ValueError, match="encode: vae_tiling and vae_tile_px are the decoder's"):
        args = AppArgs.model_validate({"encoder": {"vae_tiling": "on"}})
        stage_configs(args, read_family_traits(resolve_model_folder(args)))
    with pytest.raises(ValidationError, match="vae_tile_px"):
        AppArgs.model_validate({"decoder": {"vae_tile_px": 100}})


def test_default_steps_a_models_schedule_cannot_make_fail_the_build():
    from zoo import tiny_families

    folder = str(tiny_families.ensure_tiny_qwen_image())  # shift_terminal 0.02: at least 2 steps
    args = AppArgs.model_validate({"model_path": folder, "limits": {"default_steps": 1}})
    with pytest.raises(ValueError, match="limits.default_steps: 1 is too few for this model, which needs at least 2"):
        stage_configs(args, read_family_traits(resolve_model_folder(args)))
    args = AppArgs.model_validate({"model_path": folder, "limits": {"default_steps": 2}})
    assert set(stage_configs(args, read_family_traits(resolve_model_folder(args)))) == {ENCODE, DENOISE, DECODE}


def test_a_typo_in_compile_buckets_fails_the_app_build_not_a_replica_start():
    with pytest.raises(ValidationError, match="WxH or WxHxF"):
        StageArgs(compile="blocks", compile_buckets=["832x480", "1280by720"])
    assert StageArgs(compile="blocks", compile_buckets=["832x480"]).compile_config().buckets[0].shapes == (
        RequestShape(480, 832),)
    assert StageArgs().compile_config() is None
