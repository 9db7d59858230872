"""Adapter files the LoRA tests build themselves: random A/B at a given rank on a model's Linears,
saved as diffusers (``transformer.<module>.lora_A.weight``) or PEFT (``base_model.model.<module>...``
plus ``adapter_config.json``) safetensors, and the diffusers/PEFT reference that applies them."""
from __future__ import annotations

import json
import pathlib
from typing import Sequence

import torch
from safetensors.torch import save_file
from torch import nn

# Attention projections and the feed-forward's Linears: what style adapters usually target.
TARGETS = ("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out",
           "ffn.net.0.proj", "ffn.net.2", "ff.net.0.proj", "ff.net.2", "proj_mlp", "proj_out")


def targets(model: nn.Module, suffixes: Sequence[str] = TARGETS) -> list[str]:
    return [name for name, module in model.named_modules()
            if isinstance(module, nn.Linear) and any(name == s or name.endswith("." + s) for s in suffixes)]


def random_weights(model: nn.Module, rank: int = 4, seed: int = 0,
                   modules: Sequence[str] | None = None) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """A ~ N(0, 1/in), B ~ N(0, 1/rank): each term moves its Linear's output by about its input's scale."""
    generator = torch.Generator().manual_seed(seed)
    weights = {}
    for name in modules if modules is not None else targets(model):
        linear = model.get_submodule(name)
        weights[name] = (torch.randn(rank, linear.in_features, generator=generator) / linear.in_features ** 0.5,
                         torch.randn(linear.out_features, rank, generator=generator) / rank)
    return weights


def save_diffusers(weights: dict, path: pathlib.Path, prefix: str = "transformer") -> pathlib.Path:
    tensors = {}
    for name, (a, b) in weights.items():
        tensors[f"{prefix}.{name}.lora_A.weight"] = a.contiguous()
        tensors[f"{prefix}.{name}.lora_B.weight"] = b.contiguous()
    save_file(tensors, str(path))
    return path


def save_peft(weights: dict, folder: pathlib.Path, alpha: float) -> pathlib.Path:
    """PEFT's ``save_pretrained`` layout: adapter_model.safetensors + adapter_config.json."""
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for name, (a, b) in weights.items():
        tensors[f"base_model.model.{name}.lora_A.weight"] = a.contiguous()
        tensors[f"base_model.model.{name}.lora_B.weight"] = b.contiguous()
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    rank = next(iter(weights.values()))[0].shape[0]
    (folder / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": sorted(weights)}))
    return folder


def with_diffusers_lora(model: nn.Module, adapters: Sequence[tuple[str, pathlib.Path, float]]) -> nn.Module:
    """``model`` with diffusers' own ``load_lora_adapter`` + ``set_adapters`` (unfused, via peft)."""
    for name, path, _ in adapters:
        model.load_lora_adapter(str(path), prefix="transformer", adapter_name=name)
    model.set_adapters([name for name, _, _ in adapters], [scale for _, _, scale in adapters])
    return model
