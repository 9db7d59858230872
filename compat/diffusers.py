"""diffusers' private API, one function per use: its tensor-parallel plans and checks, and pipeline
internals the stage adapters call. Runs in whichever process calls it.

diffusers is imported inside each function, never here: importing it costs 1.2-2.2 s of CPU (it pulls
in ``torch._dynamo``) and the planner, which imports this module's neighbours, must not pay it.
Public instead of private: the tensor-parallel config (``diffusers.TensorParallelConfig``) and the
shard-spec check (``diffusers.hooks.tensor_parallel.resolve_tp_shard_specs``) are public.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from compat.checked import relies_on

CHECKED = ("0.42.1", "0.42.1")

TP_WHY = "diffusers' tensor parallelism applies its plans only inside from_pretrained(distributed_config=...)"


@relies_on("diffusers", "ModelMixin._tp_plan", CHECKED, TP_WHY)
def tp_plan_of(model_class: type) -> dict[str, Any] | None:
    """The tensor-parallel plan diffusers ships on a model class (None when it ships none)."""
    return getattr(model_class, "_tp_plan", None)


@relies_on("diffusers", "diffusers.hooks.tensor_parallel._check_tp_supported", CHECKED, TP_WHY)
def check_tp_supported(model: nn.Module, plan: dict[str, Any], heads: int | None, degree: int) -> None:
    """diffusers' refusals for sharding ``model`` ``degree`` ways: heads that do not divide, a quantized,
    offloaded or adapter-wrapped model (raises diffusers' own error)."""
    from diffusers import TensorParallelConfig
    from diffusers.hooks.tensor_parallel import _check_tp_supported

    _check_tp_supported(type(model).__name__, plan, heads, TensorParallelConfig(tp_degree=degree), model=model)


@relies_on("diffusers", "diffusers.hooks.tensor_parallel._resolve_tp_plan", CHECKED, TP_WHY)
def resolve_tp_plan(model: nn.Module, plan: dict[str, Any]) -> list[tuple[nn.Module, dict[str, Any]]]:
    """The blocks ``plan`` names in ``model``, each with its rules relative to the block."""
    from diffusers.hooks.tensor_parallel import _resolve_tp_plan

    return _resolve_tp_plan(model, plan)


@relies_on("diffusers", "diffusers.hooks.tensor_parallel._styles", CHECKED, TP_WHY)
def tp_styles(relative_plan: dict[str, Any]) -> dict[str, Any]:
    """A block's relative plan as torch ``ParallelStyle`` objects, for ``parallelize_module``."""
    from diffusers.hooks.tensor_parallel import _styles

    return _styles(relative_plan)


@relies_on("diffusers", "FluxPipeline._unpack_latents / QwenImagePipeline._unpack_latents", CHECKED,
           "the packed-latent layout is the pipeline's own; it exposes no public unpacking")
def unpack_latents(pipe: Any, latents: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """A packed-latent pipeline's (Flux, Qwen-Image) token sequence back as a latent image."""
    return type(pipe)._unpack_latents(latents, height, width, pipe.vae_scale_factor)


@relies_on("diffusers", "FluxPipeline._pack_latents / QwenImagePipeline._pack_latents", CHECKED,
           "an image edit's noised start is packed as the pipeline packs its latents; no public packing")
def pack_latents(pipe: Any, latents: torch.Tensor, batch: int, channels: int, height: int, width: int) -> torch.Tensor:
    """A latent image (Flux: [n, c, h, w]; Qwen-Image: [n, 1, c, h, w]) as the pipeline's token sequence."""
    return type(pipe)._pack_latents(latents, batch, channels, height, width)


@relies_on("diffusers", "FluxPipeline._prepare_latent_image_ids / FluxKontextPipeline._prepare_latent_image_ids",
           CHECKED, "a packed latent image's position ids are the pipeline's own; it exposes none")
def latent_image_ids(pipe: Any, height: int, width: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """The position ids ([height x width, 3]: 0, row, column) of a packed latent image of ``height`` x ``width``
    tokens, as a Flux pipeline makes them."""
    return type(pipe)._prepare_latent_image_ids(1, height, width, device, dtype)


@relies_on("diffusers", "FluxKontextPipeline._encode_vae_image / QwenImageEditPlusPipeline._encode_vae_image",
           CHECKED, "the image an in-context edit takes is encoded as its pipeline encodes it; no public method does")
def encode_vae_image(pipe: Any, image: torch.Tensor) -> torch.Tensor:
    """A preprocessed image's latents as FLUX.1 Kontext's and Qwen-Image-Edit's pipelines take them in context:
    the VAE's mode (no draw), shifted and scaled (FLUX.1) or normalised by the VAE's mean and std (Qwen)."""
    return pipe._encode_vae_image(image=image, generator=None)


@relies_on("diffusers", "DiffusionPipeline._execution_device", CHECKED,
           "the device a pipeline runs on, after its offload hooks, has no public accessor")
def execution_device(pipe: Any) -> torch.device:
    """The device the pipeline's modules run on (it walks every module's hooks and parameters)."""
    return pipe._execution_device


@relies_on("diffusers", "ModelMixin._keep_in_fp32_modules", CHECKED,
           "from_pretrained(torch_dtype=...) reads it; diffusers exposes it no other way")
def keep_in_fp32_modules(model: Any) -> frozenset[str]:
    """Module names a model class keeps in fp32 whatever dtype it is loaded in (empty when none)."""
    return frozenset(getattr(model, "_keep_in_fp32_modules", None) or ())


@relies_on("diffusers", "ModelMixin._repeated_blocks", CHECKED,
           "diffusers declares a model's repeated block classes (compile_repeated_blocks' targets) only there")
def repeated_block_names(model_class: type) -> tuple[str, ...]:
    """The class names of ``model_class``'s repeated blocks, as diffusers declares them (empty: none)."""
    return tuple(getattr(model_class, "_repeated_blocks", None) or ())
