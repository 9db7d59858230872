"""The denoising timesteps of Wan's flow-matching UniPC scheduler, without importing diffusers.

A two-expert model (Wan2.2 A14B) runs its high-noise expert while the timestep is at or above
``boundary_ratio x num_train_timesteps``, so how many steps each expert runs, and so what the plan
weighs each expert's bytes by, follows from the scheduler's timesteps. Importing diffusers for them
costs 1.2-2.2 s of CPU (it pulls in ``torch._dynamo``), twice a plan's own time; this is
``UniPCMultistepScheduler.set_timesteps`` for the configuration Wan's folders ship
(``use_flow_sigmas``, a fixed ``flow_shift``), checked equal to diffusers' in
tests/offload_core/planner/test_flow_timesteps.py. Any other configuration returns None: the caller
asks diffusers. Also the fewest steps a scheduler's schedule is finite at (:func:`min_steps`), for the
planner and the service's request checks. Torch only; runs in whichever process plans or checks.
"""
from __future__ import annotations

from typing import Any, Mapping

import torch

# Options that change UniPC's flow sigmas from the plain shifted linspace reproduced here.
_OTHER_SIGMAS = ("use_dynamic_shifting", "shift_terminal", "use_karras_sigmas", "use_exponential_sigmas",
                 "use_beta_sigmas")


def min_steps(config: Mapping[str, Any]) -> int:
    """The fewest steps a flow-match scheduler ``config`` makes a finite schedule with. diffusers stretches
    the schedule so that its last sigma is ``shift_terminal`` (Qwen-Image: 0.02); with one step that
    sigma is also the first (1.0), and the stretch divides 0 by 0: NaN timesteps, a black image."""
    return 1 if config.get("shift_terminal") is None else 2


def unipc_flow_timesteps(steps: int, config: Mapping[str, Any]) -> torch.Tensor | None:
    """The int64 timesteps ``UniPCMultistepScheduler(**config).set_timesteps(steps)`` makes, or None when
    ``config`` is not the plain flow-sigma one this reproduces."""
    if not config.get("use_flow_sigmas") or any(config.get(key) for key in _OTHER_SIGMAS):
        return None
    train = int(config.get("num_train_timesteps", 1000))
    shift = float(config.get("flow_shift", 1.0))
    # np.linspace(1, 1 / train, steps + 1)[:-1] as numpy computes it (torch.linspace rounds otherwise):
    sigmas = torch.arange(steps, dtype=torch.float64) * ((1 / train - 1) / steps) + 1
    sigmas = shift * sigmas / (1 + (shift - 1) * sigmas)
    if abs(float(sigmas[0]) - 1) < 1e-6:  # diffusers nudges the first sigma off 1 (a log of 0 otherwise)
        sigmas[0] -= 1e-6
    return (sigmas * train).to(torch.int64)


def high_noise_steps(steps: int, config: Mapping[str, Any], boundary_ratio: float) -> int | None:
    """Steps at or above the boundary timestep (the first expert's), or None: ask diffusers."""
    timesteps = unipc_flow_timesteps(steps, config)
    if timesteps is None:
        return None
    return int((timesteps >= boundary_ratio * int(config.get("num_train_timesteps", 1000))).sum())


__all__ = ["high_noise_steps", "unipc_flow_timesteps"]
