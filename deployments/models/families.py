"""Model families, as the rest of the service calls them: each call goes to the folder's adapter.

What a family means lives in its module under ``deployments/models/`` (see
``deployments.models.adapter``); this module is the one door to them, so no caller branches on the
family. The staged split is exact: the staged result is bitwise the in-process
``pipe(prompt, generator=seed)`` result (tests/deployments/test_families.py and the conformance
suite, tests/deployments/models/test_conformance.py, pin it).
"""
from __future__ import annotations

from typing import Callable

import torch

from compat.diffusers import execution_device
from deployments.models.adapter import (  # noqa: F401 (re-exported: the service's names for them)
    CPU,
    FamilyTraits,
    ReferenceImage,
    UnsupportedModelFolder,
    generator_for,
)
from deployments.models.registry import adapter_for, read_family_traits  # noqa: F401 (re-exported)
from deployments.wire.spec import DenoiseProgress, EditSource, EncodedPrompt, GenerationSpec, PipelineStage


def stage_component_names(facts: FamilyTraits, stage: PipelineStage) -> tuple[str, ...]:
    return adapter_for(facts).modules(facts, stage)


def uses_per_request(facts: FamilyTraits, stage: PipelineStage, steps: int, guidance_scale: float,
                     batched: bool = False) -> dict[str, int]:
    """Forward passes per request of each of the stage's components (what the planner weighs bytes by).

    ``batched``: the Denoiser's step batching runs guidance's two branches in one forward.
    """
    return adapter_for(facts).uses_per_request(facts, stage, steps, guidance_scale, batched)


def stage_phases(facts: FamilyTraits, stage: PipelineStage) -> tuple[tuple[str, ...], ...]:
    """The stage's components grouped by what runs at once (Wan2.2 A14B's denoiser: one expert at a time)."""
    return adapter_for(facts).phases(facts, stage)


def warmup_prompt(facts: FamilyTraits) -> str:
    """The warm-up's prompt: one that runs every prompt-dependent component (HunyuanVideo 1.5: quoted text)."""
    return adapter_for(facts).warmup_prompt(facts)


def warmup_steps(facts: FamilyTraits) -> int:
    """Denoising steps a warm-up call runs so that every denoiser component runs (Wan2.2 A14B: both experts)."""
    return max(adapter_for(facts).warmup_steps(facts), facts.min_steps)


def load_stage_pipeline(facts: FamilyTraits, stage: PipelineStage, dtype: torch.dtype,
                        loaded: dict[str, torch.nn.Module] | None = None):
    """The family's pipeline with only ``stage``'s components loaded (the rest None), safetensors only;
    ``loaded``: components loaded elsewhere (a tensor-parallel rank's slices), used as given."""
    return adapter_for(facts).load_stage_pipeline(facts, stage, dtype, loaded)


def stage_modules(pipe, facts: FamilyTraits, stage: PipelineStage) -> dict[str, torch.nn.Module]:
    return {name: getattr(pipe, name) for name in stage_component_names(facts, stage)}


def encode(pipe, facts: FamilyTraits, spec: GenerationSpec, device: torch.device) -> EncodedPrompt:
    return adapter_for(facts).encode(pipe, facts, spec, device)


def condition(pipe, facts: FamilyTraits, spec: GenerationSpec,
              device: torch.device) -> torch.Tensor | EditSource | None:
    """The reference image's conditioning (image-to-video), or an image edit's start
    (``deployments.models.edits``), on the CPU; None without a reference image."""
    return adapter_for(facts).condition(pipe, facts, spec, device)


def condition_shape(facts: FamilyTraits, spec: GenerationSpec) -> GenerationSpec:
    """The shape the decoder stage's :func:`condition` call is leased at (its activations predicted for):
    the request's own, or the size the family fits the image to (FLUX.1 Kontext: about a megapixel)."""
    return adapter_for(facts).condition_shape(facts, spec)


def denoise(pipe, facts: FamilyTraits, encoded: EncodedPrompt, spec: GenerationSpec, device: torch.device,
            on_step: Callable[[DenoiseProgress], None] | None = None) -> torch.Tensor:
    """Latents exactly as ``pipe(..., output_type="latent")`` returns them, on the CPU. Text-to-image and
    -video only: an image edit runs through the family's stepper (``deployments.models.edits``)."""
    if spec.strength is not None:
        raise ValueError(f"request {spec.request_id} is an image edit: it runs through the family's stepper "
                         "(begin_edit), not the text-to-image pipeline")
    return adapter_for(facts).denoise(pipe, facts, encoded, spec, device, on_step)


def decode(pipe, facts: FamilyTraits, latents: torch.Tensor, spec: GenerationSpec,
           device: torch.device | None = None) -> torch.Tensor:
    """Frames (n, frames, H, W, 3) float32 in [0, 1]: the pipeline's ``output_type="np"`` result.

    ``device``: where the VAE runs; None asks the pipeline, which walks every module's hooks and
    parameters (30 % of the tiny Wan's decode in a replica, py-spy): stage replicas pass theirs."""
    device = execution_device(pipe) if device is None else device
    return adapter_for(facts).decode(pipe, facts, latents, spec, device)


def load_full_pipeline(facts: FamilyTraits, dtype: torch.dtype):
    return adapter_for(facts).load_full_pipeline(facts, dtype)


def reference_frames(pipe, facts: FamilyTraits, spec: GenerationSpec) -> torch.Tensor:
    """The in-process pipeline's result for ``spec``, in the decoder's layout (the bitwise reference)."""
    return adapter_for(facts).reference_frames(pipe, facts, spec)
