"""build_app scales the Denoiser on work when its options autoscale (AppArgs.denoiser_scales_on), without Ray."""
from __future__ import annotations

from deployments.app import AppArgs, build_app_with
from deployments.capacity.work_autoscaling import POLICY_PATH, ScalingSignal, dropped_policy, with_policy

AUTOSCALING = {"min_replicas": 1, "max_replicas": 3, "target_ongoing_requests": 2}


def _denoiser_autoscaling(args: dict, options: dict):
    encoder, denoiser, decoder, _ = build_app_with(AppArgs.model_validate(args), options)._bound_deployment.init_args
    return denoiser._bound_deployment._deployment_config.autoscaling_config


def test_an_autoscaling_denoiser_gets_the_work_policy_with_the_apps_target():
    config = _denoiser_autoscaling({"denoiser_target_work_s": 12.5}, {"Denoiser": {"autoscaling_config": AUTOSCALING}})
    assert config.policy.policy_function == POLICY_PATH
    assert config.policy.policy_kwargs == {"target_work_s": 12.5}
    assert (config.min_replicas, config.max_replicas) == (1, 3)  # the deployment's own bounds, as set


def test_the_off_switch_leaves_serves_ongoing_requests_policy():
    config = _denoiser_autoscaling({"denoiser_scales_on": "requests"}, {"Denoiser": {"autoscaling_config": AUTOSCALING}})
    assert config.policy.is_default_policy_function()


def test_a_fixed_replica_count_or_a_policy_of_the_callers_own_is_left_alone():
    assert _denoiser_autoscaling({}, {}) is None
    own = {**AUTOSCALING, "policy": {"policy_function": "ray.serve.autoscaling_policy:default_autoscaling_policy"}}
    assert with_policy({"autoscaling_config": own}, ScalingSignal.WORK, 30.0)["autoscaling_config"] == own


def test_a_config_file_autoscaling_config_without_the_policy_is_warned_about():
    said = dropped_policy("Denoiser", {"autoscaling_config": AUTOSCALING}, ScalingSignal.WORK)
    assert "scales on ongoing requests, not on work" in said and POLICY_PATH in said
    named = {"autoscaling_config": {**AUTOSCALING, "policy": {"policy_function": POLICY_PATH}}}
    assert dropped_policy("Denoiser", named, ScalingSignal.WORK) is None
    assert dropped_policy("Denoiser", {"autoscaling_config": AUTOSCALING}, ScalingSignal.REQUESTS) is None
    assert dropped_policy("Denoiser", {}, ScalingSignal.WORK) is None  # no config file override
