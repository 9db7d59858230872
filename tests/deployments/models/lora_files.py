"""LoRA adapter files the tests build themselves: random A/B at a given rank on a model's Linear
layers, saved as diffusers/PEFT safetensors (``transformer.<module>.lora_A.weight`` (rank, in) and
``lora_B.weight`` (out, rank)), the format ``load_lora_weights`` reads. Nothing downloads."""
from __future__ import annotations

import pathlib

import torch
from safetensors.torch import save_file
from torch import nn

# The Linear layers adapters usually target: attention projections and the feed-forward's.
TARGETS = ("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out",
           "net.0.proj", "net.2", "proj_mlp")


def target_linears(model: nn.Module) -> list[str]:
    """The qualified names of ``model``'s Linear layers an adapter of :data:`TARGETS` adapts."""
    return [name for name, module in model.named_modules()
            if isinstance(module, nn.Linear) and any(name == t or name.endswith("." + t) for t in TARGETS)]


def write_adapter(model: nn.Module, path: pathlib.Path, rank: int = 4, seed: int = 0, strength: float = 0.5,
                  prefix: str = "transformer") -> pathlib.Path:
    """A random rank-``rank`` adapter for ``model``'s target Linears at ``path`` (a .safetensors file).

    A ~ N(0, 1/in), B ~ N(0, strength/rank): the low-rank term moves each layer's output by about
    ``strength`` of its input's scale, enough to change the image well beyond rounding."""
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for name in target_linears(model):
        linear = model.get_submodule(name)
        a = torch.randn(rank, linear.in_features, generator=generator) / linear.in_features ** 0.5
        b = torch.randn(linear.out_features, rank, generator=generator) * strength / rank
        tensors[f"{prefix}.{name}.lora_A.weight"] = a.contiguous()
        tensors[f"{prefix}.{name}.lora_B.weight"] = b.contiguous()
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path))
    return path
