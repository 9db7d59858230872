"""A preview is the flow estimate of the final latents only where the scheduler integrates a flow."""
from __future__ import annotations

import torch
from diffusers import DDIMScheduler, FlowMatchEulerDiscreteScheduler, UniPCMultistepScheduler

from deployments.models.steppers import BatchKey, StepRequest, integrates_flow
from deployments.wire.spec import GenerationSpec


def _request(scheduler, steps: int = 4) -> StepRequest:
    scheduler.set_timesteps(steps)
    spec = GenerationSpec("p", "a fox", None, 16, 16, 1, steps, 1.0, 0, 1, partial_images=1)
    latents = torch.randn(1, 4, 2, 2, generator=torch.Generator().manual_seed(0))
    return StepRequest(spec, BatchKey((4, 2, 2), torch.float32, 1, False), scheduler, scheduler.timesteps,
                       latents, {}, None, on_step=lambda progress: None)


def test_only_flow_schedulers_are_read_as_flows():
    assert integrates_flow(FlowMatchEulerDiscreteScheduler())
    assert integrates_flow(UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True))
    assert not integrates_flow(UniPCMultistepScheduler())  # epsilon prediction
    assert not integrates_flow(DDIMScheduler())


def test_a_scheduler_that_is_no_flow_previews_its_stepped_latents_not_a_flow_estimate():
    request = _request(DDIMScheduler())
    sample, noise = request.latents, torch.ones_like(request.latents)
    request.advance(noise)
    assert torch.equal(request.preview(sample, noise)[0], request.latents)


def test_a_flow_schedulers_preview_is_x_t_minus_sigma_t_v_at_the_sigma_the_step_used():
    request = _request(FlowMatchEulerDiscreteScheduler())
    sample, v = request.latents, torch.ones_like(request.latents)
    sigma = request.scheduler.sigmas[0].item()
    request.advance(v)
    assert torch.allclose(request.preview(sample, v)[0], sample - sigma * v)
    assert not torch.equal(request.preview(sample, v)[0], request.latents)
