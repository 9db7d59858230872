"""Real-size models on torch's meta device, from configs/models/real_model_configs.json.

Planning a 14B denoiser needs its exact parameter shapes and dtypes, not its weights: building
the module under ``torch.device("meta")`` gives both and allocates nothing, so real-scale plans
run on a laptop. Every config key in the json is passed through, because the library defaults
describe small variants (T5's default d_model is 512, umT5-XXL's is 4096).

diffusers and transformers are imported inside :func:`build_meta` only: offload_core stays
importable with torch alone. The planner builds from the committed skeletons instead where they
match the installed libraries (offload_core/planner/skeletons.py): same shapes, no library import.

Runs in whichever process plans: ``offload-serve plan`` and each stage replica (through ``cluster/replica/plan.py``).
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Mapping

import torch
from torch import nn

from compat.diffusers import keep_in_fp32_modules
from compat.torch import own_buffers, own_parameters
from offload_core.planner.config_file import CONFIG_PATH, UnknownModel, config_file, resolve_name  # noqa: F401 (re-exported)

# transformer_2: Wan2.2 A14B's low-noise expert (the same class as the high-noise ``transformer``);
# text_encoder_3: SD3.5's T5-XXL (after its two CLIPs); image_encoder: Wan2.1 image-to-video's CLIP vision tower,
# HunyuanVideo 1.5 image-to-video's SigLIP.
COMPONENTS = ("transformer", "transformer_2", "text_encoder", "text_encoder_2", "text_encoder_3", "image_encoder", "vae")
# Classes the json or a local folder may name, by library; anything else is a typo or an unreviewed model.
_DIFFUSERS_CLASSES = frozenset({
    "WanTransformer3DModel", "FluxTransformer2DModel", "AutoencoderKLWan", "AutoencoderKL",
    "SD3Transformer2DModel", "ZImageTransformer2DModel", "QwenImageTransformer2DModel", "AutoencoderKLQwenImage",
    "HunyuanVideo15Transformer3DModel", "AutoencoderKLHunyuanVideo15",
})
_TRANSFORMERS_CLASSES = frozenset({
    "UMT5EncoderModel", "T5EncoderModel", "CLIPTextModel", "CLIPTextModelWithProjection", "Qwen3Model",
    "Qwen2_5_VLForConditionalGeneration", "Qwen2_5_VLTextModel", "CLIPVisionModelWithProjection", "SiglipVisionModel",
})
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class ComponentSpec:
    """One component of a real pipeline as published: class, dtype, full config, layer groups."""

    model_name: str
    component: str
    class_name: str
    dtype: torch.dtype
    config: Mapping[str, Any]  # read-only; every published key
    layer_groups: tuple[str, ...]  # empty when the json declares none (the engine's defaults apply)


def model_names() -> tuple[str, ...]:
    """The real pipelines described in the config file."""
    # Model entries name a pipeline or inherit one; the rest of the file is GPU and link facts.
    return tuple(k for k, v in config_file().items() if isinstance(v, dict) and ("pipeline" in v or "same_as" in v))


def _model_entry(model_name: str) -> dict[str, Any]:
    """The model's entry with "same_as" resolved and "transformer_overrides" applied (a deep copy)."""
    raw = config_file()
    entry = copy.deepcopy(raw[resolve_name(model_name, model_names(), "model")])
    base_name = entry.pop("same_as", None)
    if base_name is None:
        return entry
    base = _model_entry(base_name)
    overrides = entry.pop("transformer_overrides", {})
    base["transformer"]["config"].update(overrides)
    base.update(entry)
    return base


def pipeline_class(model_name: str) -> str:
    """The diffusers pipeline class the model is published as (``WanPipeline``, ``FluxPipeline``)."""
    return _model_entry(model_name)["pipeline"]


def component_names(model_name: str) -> tuple[str, ...]:
    """The model's components in the config file's order (the order plans list them in)."""
    return tuple(name for name in _model_entry(model_name) if name in COMPONENTS)


def component_spec(model_name: str, component: str) -> ComponentSpec:
    """The published class, dtype, config and layer groups of one component of a real model."""
    entry = _model_entry(model_name)
    if component not in COMPONENTS or component not in entry:
        present = [c for c in COMPONENTS if c in entry]
        raise UnknownModel(f"{model_name!r} has no component {component!r}; it has: {', '.join(present)}")
    comp = entry[component]
    dtype_name = comp.get("dtype", "float32")
    if dtype_name not in _DTYPES:
        raise ValueError(f"{model_name}/{component}: unsupported dtype {dtype_name!r} in {CONFIG_PATH}")
    return ComponentSpec(
        model_name=model_name,
        component=component,
        class_name=comp["class"],
        dtype=_DTYPES[dtype_name],
        config=MappingProxyType(dict(comp["config"])),
        layer_groups=tuple(comp.get("layer_groups", ())),
    )


def _instantiate(class_name: str, config: Mapping[str, Any]) -> nn.Module:
    if class_name in _DIFFUSERS_CLASSES:
        import diffusers

        return getattr(diffusers, class_name).from_config(dict(config))
    if class_name in _TRANSFORMERS_CLASSES:
        import transformers

        cls = getattr(transformers, class_name)
        return cls(cls.config_class(**config))
    known = ", ".join(sorted(_DIFFUSERS_CLASSES | _TRANSFORMERS_CLASSES))
    raise ValueError(f"class {class_name!r} is not one built on the meta device; known: {known}")


def _cast(module: nn.Module, dtype: torch.dtype) -> None:
    """Cast floating tensors to ``dtype`` the way diffusers' from_pretrained(torch_dtype=...) does.

    diffusers keeps the modules named in ``_keep_in_fp32_modules`` (Wan: rope, time embedder,
    norms, scale-shift tables) in fp32 for stability, so a plan must count those bytes as fp32.
    """
    keep = keep_in_fp32_modules(module)
    # Tied tensors (UMT5's shared table and encoder.embed_tokens) must stay one tensor after the cast.
    retyped: dict[int, torch.Tensor] = {}
    for owner_name, owner in module.named_modules(remove_duplicate=False):
        for registry in (own_parameters(owner), own_buffers(owner)):
            for key, tensor in registry.items():
                if tensor is None or not tensor.is_floating_point():
                    continue
                if id(tensor) not in retyped:
                    # Same test as diffusers: any dotted component of the tensor's name is kept.
                    parts = f"{owner_name}.{key}".split(".")
                    retyped[id(tensor)] = _retyped(tensor, torch.float32 if keep.intersection(parts) else dtype)
                registry[key] = retyped[id(tensor)]


def _retyped(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if isinstance(tensor, nn.Parameter):
        return nn.Parameter(tensor.detach().to(dtype), requires_grad=tensor.requires_grad)
    return tensor.to(dtype)


def build_meta(class_name: str, config: Mapping[str, Any], dtype: torch.dtype) -> nn.Module:
    """``class_name`` (a diffusers or transformers class) at full size on the meta device, in ``dtype``.

    Allocates nothing; floating tensors are cast as diffusers' loader would (see :func:`_cast`).
    """
    with torch.device("meta"):
        module = _instantiate(class_name, config)
    _cast(module, dtype)
    module.eval()
    stray = [n for n, t in module.state_dict().items() if t.device.type != "meta"]
    assert not stray, f"{class_name}: tensors allocated off the meta device: {stray[:3]}"
    return module


def meta_component(model_name: str, component: str) -> nn.Module:
    """Build a real-size component on the meta device in its published dtype; allocates nothing."""
    spec = component_spec(model_name, component)
    return build_meta(spec.class_name, spec.config, spec.dtype)


def boundary_ratio(model_name: str) -> float | None:
    """Where a two-expert model switches experts: timesteps >= ratio x 1000 run ``transformer``."""
    return _model_entry(model_name).get("boundary_ratio")


def scheduler_config(model_name: str) -> dict[str, Any]:
    """The published scheduler's class and config (its flow_shift decides each expert's steps)."""
    return copy.deepcopy(_model_entry(model_name)["scheduler"])


def pipeline_defaults(model_name: str) -> dict[str, Any]:
    """The model's published generation defaults (height, width, frames, steps, guidance...)."""
    return dict(_model_entry(model_name)["pipeline_defaults"])
