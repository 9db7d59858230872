"""The models the GPU check streams and what it needs around them (``bench/gpu_check.py`` imports it).

The zoo's medium Wan denoiser; real-size Wan2.1-1.3B with random weights (drawn once per run) and
its file-mapped copy (saved to a safetensors folder and loaded as from_pretrained maps it); their
inputs; the bytes a step streams.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from compat.diffusers import keep_in_fp32_modules
from offload_core.layout import declared_layer_groups, resolve_layer_group


def medium_denoiser(dtype: torch.dtype):
    from diffusers import WanTransformer3DModel

    from zoo.tiny import ensure_medium_wan

    return WanTransformer3DModel.from_pretrained(ensure_medium_wan() / "transformer", torch_dtype=dtype).eval()


_REAL_WEIGHTS: dict[tuple, dict[str, torch.Tensor]] = {}


def real_denoiser(dtype: torch.dtype, blocks: int | None):
    """Wan2.1-1.3B's transformer at real size (``blocks`` caps the layer count), random weights.

    The weights are drawn once per run and cloned into each build: drawing 1.4 B random numbers
    takes ~15 s, and the check builds the model once per way.
    """
    from diffusers import WanTransformer3DModel

    config = json.loads((Path(__file__).resolve().parents[1] / "configs/models/real_model_configs.json").read_text())
    cfg = dict(config["wan2.1-t2v-1.3b"]["transformer"]["config"])
    if blocks is not None:
        cfg["num_layers"] = blocks
    with torch.device("meta"):
        model = WanTransformer3DModel.from_config(cfg)
    model = model.to_empty(device="cpu")
    keep = set(keep_in_fp32_modules(model))  # as from_pretrained(torch_dtype=...) keeps them
    weights = _REAL_WEIGHTS.get((dtype, blocks))
    if weights is None:
        generator = torch.Generator().manual_seed(0)
        weights = _REAL_WEIGHTS[(dtype, blocks)] = {}
        for name, p in model.named_parameters():  # random weights at a trained model's scale
            drawn = torch.randn(p.shape, generator=generator) * 0.02
            weights[name] = drawn if keep.intersection(name.split(".")) else drawn.to(dtype)
    for name, p in model.named_parameters():
        p.data = weights[name].clone()
    for b in model.buffers():
        b.zero_()
    return model.eval()


def inputs(model, frames: int, height: int, width: int, text_tokens: int, device, dtype):
    g = torch.Generator().manual_seed(1)
    cfg = model.config
    latent = torch.randn(1, cfg.in_channels, frames, height, width, generator=g)
    text = torch.randn(1, text_tokens, cfg.text_dim, generator=g)
    return {"hidden_states": latent.to(device, dtype), "timestep": torch.tensor([500], device=device),
            "encoder_hidden_states": text.to(device, dtype), "return_dict": False}


def layers_of(model) -> list:
    return [layer for g in declared_layer_groups(model) for layer in resolve_layer_group(model, g).layers]


def file_mapped_fraction(layers) -> float:
    """Of the layers' parameter bytes, the fraction that are views of a file mapping (/proc/self/maps)."""
    from offload_core.host.maps import MapsSnapshot

    params = [p.data for layer in layers for p in layer.parameters()]
    total = sum(p.numel() * p.element_size() for p in params)
    return round(MapsSnapshot.take().mapped_bytes(params) / total, 4) if total else 0.0


def mapped_copy(build, folder: Path):
    """A builder of ``build``'s model saved once into ``folder`` (safetensors) and loaded from it, so
    its weights are views of the file mapping as from_pretrained leaves them: the MAPPED tier at real size."""
    def load(dtype: torch.dtype):
        if not (folder / "config.json").exists():
            build(dtype).save_pretrained(folder, safe_serialization=True)
        from diffusers import WanTransformer3DModel

        model = WanTransformer3DModel.from_pretrained(folder, torch_dtype=dtype)
        for buffer in model.buffers():  # as real_denoiser leaves its buffers: the same model, bit for bit
            buffer.zero_()
        return model.eval()
    return load


def layer_bytes(model) -> int:
    """Bytes every step streams: each layer's flat layout (what the engine copies), all layers streamed."""
    from offload_core.layout import layer_parameters, plan_layer_layout

    return sum(plan_layer_layout(f"{g}.{i}", [(n, p.data) for n, p in layer_parameters(layer)]).nbytes
               for g in declared_layer_groups(model) for i, layer in enumerate(resolve_layer_group(model, g).layers))
