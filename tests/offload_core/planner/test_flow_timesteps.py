"""Wan's UniPC flow timesteps without diffusers are diffusers' own, so the experts' steps split the same."""
from __future__ import annotations

import pytest
import torch
from diffusers import UniPCMultistepScheduler

from offload_core.planner.flow_timesteps import high_noise_steps, unipc_flow_timesteps

WAN = {"prediction_type": "flow_prediction", "use_flow_sigmas": True, "num_train_timesteps": 1000}


@pytest.mark.parametrize("shift", [1.0, 3.0, 5.0, 12.0])
def test_unipc_flow_timesteps_are_diffusers_own_for_every_step_count(shift):
    config = {**WAN, "flow_shift": shift}
    for steps in range(1, 81):
        scheduler = UniPCMultistepScheduler.from_config(config)
        scheduler.set_timesteps(steps)
        assert torch.equal(unipc_flow_timesteps(steps, config), scheduler.timesteps), (shift, steps)
        expected = int((scheduler.timesteps >= 0.875 * 1000).sum())
        assert high_noise_steps(steps, config, 0.875) == expected, (shift, steps)


def test_a_configuration_it_does_not_reproduce_is_left_to_diffusers():
    assert unipc_flow_timesteps(40, {**WAN, "flow_shift": 3.0, "use_karras_sigmas": True}) is None
    assert high_noise_steps(40, {"num_train_timesteps": 1000}, 0.875) is None
