"""Wan's UniPC flow timesteps without diffusers are diffusers' own, so the experts' steps split the same;
the fewest steps a flow-match schedule is finite at is what diffusers' scheduler makes finite."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, UniPCMultistepScheduler

from offload_core.planner.flow_timesteps import high_noise_steps, min_steps, unipc_flow_timesteps

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


# Qwen-Image's published scheduler (use_dynamic_shifting: its pipeline passes mu), and with no shift_terminal.
QWEN = {"base_image_seq_len": 256, "base_shift": 0.5, "max_image_seq_len": 8192, "max_shift": 0.9, "shift": 1.0,
        "shift_terminal": 0.02, "time_shift_type": "exponential", "use_dynamic_shifting": True}


@pytest.mark.parametrize("config", [QWEN, {**QWEN, "shift_terminal": None}], ids=["shift_terminal", "none"])
def test_min_steps_is_the_fewest_steps_diffusers_makes_a_finite_schedule_at(config):
    def finite(steps: int) -> bool:
        scheduler = FlowMatchEulerDiscreteScheduler.from_config(config)
        sigmas = [1.0 - i * (1.0 - 1 / steps) / max(steps - 1, 1) for i in range(steps)]  # the pipeline's linspace
        with np.errstate(invalid="ignore"):  # 0 / 0 is what is being looked for
            scheduler.set_timesteps(sigmas=sigmas, mu=0.6)
        return bool(torch.isfinite(scheduler.timesteps).all())

    fewest = min_steps(config)
    assert all(finite(steps) for steps in range(fewest, 6))
    assert fewest == 1 or not finite(fewest - 1)
