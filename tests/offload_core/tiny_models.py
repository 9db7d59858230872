"""Tiny models built directly from small configs with the real diffusers/transformers classes.

Each case builds a seeded model and its inputs and knows how to run it, so the streaming tests can
compare a streamed run with the plain one bitwise. Sizes are chosen so a forward takes milliseconds.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn


@dataclass(frozen=True)
class TinyCase:
    name: str
    build: Callable[[], nn.Module]
    inputs: Callable[[], dict]
    run: Callable[[nn.Module, dict], torch.Tensor]


def wan_transformer(num_layers: int = 4) -> nn.Module:
    """The tiny Wan transformer (WAN's model), with ``num_layers`` blocks."""
    from diffusers import WanTransformer3DModel

    torch.manual_seed(0)
    return WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12,
                                 in_channels=4, out_channels=4, text_dim=16, freq_dim=16, ffn_dim=32,
                                 num_layers=num_layers, rope_max_seq_len=32).eval()


def _wan_inputs() -> dict:
    g = torch.Generator().manual_seed(1)
    return {"hidden_states": torch.randn(1, 4, 2, 8, 8, generator=g), "timestep": torch.tensor([500]),
            "encoder_hidden_states": torch.randn(1, 6, 16, generator=g)}


def _flux() -> nn.Module:
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(0)
    return FluxTransformer2DModel(patch_size=1, in_channels=4, num_layers=2, num_single_layers=3,
                                  attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
                                  pooled_projection_dim=32, axes_dims_rope=(4, 4, 8)).eval()


def _flux_inputs() -> dict:
    g = torch.Generator().manual_seed(1)
    return {"hidden_states": torch.randn(1, 16, 4, generator=g),
            "encoder_hidden_states": torch.randn(1, 8, 32, generator=g),
            "pooled_projections": torch.randn(1, 32, generator=g), "timestep": torch.tensor([0.5]),
            "img_ids": torch.zeros(16, 3), "txt_ids": torch.zeros(8, 3)}


def _umt5() -> nn.Module:
    from transformers import UMT5Config, UMT5EncoderModel

    torch.manual_seed(0)
    config = UMT5Config(vocab_size=512, d_model=16, d_kv=8, d_ff=32, num_layers=3, num_heads=2,
                        relative_attention_num_buckets=8, dropout_rate=0.0)
    return UMT5EncoderModel(config).eval()


def _umt5_inputs() -> dict:
    g = torch.Generator().manual_seed(1)
    return {"input_ids": torch.randint(0, 512, (1, 7), generator=g)}


def _t5() -> nn.Module:
    from transformers import T5Config, T5EncoderModel

    torch.manual_seed(0)
    config = T5Config(vocab_size=512, d_model=16, d_kv=8, d_ff=32, num_layers=3, num_heads=2,
                      relative_attention_num_buckets=8, dropout_rate=0.0)
    return T5EncoderModel(config).eval()


def _clip() -> nn.Module:
    from transformers import CLIPTextConfig, CLIPTextModel

    torch.manual_seed(0)
    config = CLIPTextConfig(vocab_size=512, hidden_size=16, intermediate_size=32, num_hidden_layers=3,
                            num_attention_heads=2, max_position_embeddings=16)
    return CLIPTextModel(config).eval()


def _wan_vae() -> nn.Module:
    from diffusers import AutoencoderKLWan

    torch.manual_seed(0)
    return AutoencoderKLWan(base_dim=3, z_dim=4, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                            temperal_downsample=[False, True, True]).eval()


def _wan_vae_inputs() -> dict:
    g = torch.Generator().manual_seed(1)
    return {"z": torch.randn(1, 4, 2, 2, 2, generator=g)}


def _forward_sample(model: nn.Module, inputs: dict) -> torch.Tensor:
    with torch.no_grad():
        return model(**inputs, return_dict=False)[0]


def _encode(model: nn.Module, inputs: dict) -> torch.Tensor:
    with torch.no_grad():
        return model(**inputs).last_hidden_state


def _decode(model: nn.Module, inputs: dict) -> torch.Tensor:
    with torch.no_grad():
        return model.decode(inputs["z"], return_dict=False)[0]


WAN = TinyCase("wan_transformer", wan_transformer, _wan_inputs, _forward_sample)
FLUX = TinyCase("flux_transformer", _flux, _flux_inputs, _forward_sample)
UMT5 = TinyCase("umt5_encoder", _umt5, _umt5_inputs, _encode)
# T5 computes its relative position bias in block 0 only and passes it on: streaming must not care.
T5 = TinyCase("t5_encoder", _t5, _umt5_inputs, _encode)
CLIP = TinyCase("clip_text", _clip, _umt5_inputs, _encode)
WAN_VAE = TinyCase("wan_vae_decoder", _wan_vae, _wan_vae_inputs, _decode)
ALL_CASES = (WAN, FLUX, UMT5, WAN_VAE, T5, CLIP)


class Stack(nn.Module):
    """A minimal model with a declared group: a ModuleList of blocks between an input and output layer."""

    offload_layer_groups = ("blocks",)

    def __init__(self, width: int = 8, depth: int = 4):
        super().__init__()
        self.proj_in = nn.Linear(width, width)
        self.blocks = nn.ModuleList(ScaleBlock(width) for _ in range(depth))
        self.proj_out = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.proj_in(x)
        for block in self.blocks:
            x = block(x)
        return self.proj_out(x)


class ScaleBlock(nn.Module):
    """A linear, an elementwise scale and a transposed (non-contiguous) weight."""

    def __init__(self, width: int):
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.scale = nn.Parameter(torch.randn(width))
        # Stored transposed: a parameter whose strides are (1, width), not contiguous.
        self.mix = nn.Parameter(torch.randn(width, width).t())
        self.register_buffer("shift", torch.randn(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.linear(x) * self.scale + self.shift) @ self.mix


def toy_layer(key: str, nbytes: int, dtype: torch.dtype = torch.float32, params: int | None = None):
    """A planner layer of ``nbytes`` tensor bytes, laid out by the engine's own layout code (on meta)."""
    from offload_core.layout import plan_layer_layout
    from offload_core.planner.facts import LayerProfile

    weight = torch.empty(nbytes // dtype.itemsize, dtype=dtype, device="meta")
    return LayerProfile(key, plan_layer_layout(key, [("weight", weight)]), weight.numel() if params is None else params)


class _Block(nn.Module):
    """One linear with a residual: enough weight to stream, exact enough to compare bitwise."""

    def __init__(self, width: int):
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.linear(x))


class _Refiner(nn.Module):
    def __init__(self, width: int, depth: int):
        super().__init__()
        self.refiner_blocks = nn.ModuleList(_Block(width) for _ in range(depth))
        self.proj = nn.Linear(width, 16)


class TinyHunyuan(nn.Module):
    """HunyuanVideo's shape in miniature: a token refiner (inside ``context_embedder``) runs first on
    the text, then the double-stream and single-stream blocks; a GELU sits in the single blocks."""

    def __init__(self, layer_groups: tuple[str, ...]):
        super().__init__()
        self.offload_layer_groups = layer_groups
        self.context_embedder = _Refiner(8, 2)
        self.transformer_blocks = nn.ModuleList(_Block(16) for _ in range(3))
        self.single_transformer_blocks = nn.ModuleList([_Block(16), nn.GELU(), _Block(16)])
        self.proj_out = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
        for block in self.context_embedder.refiner_blocks:
            text = block(text)
        context = self.context_embedder.proj(text).mean(dim=1, keepdim=True)
        for block in self.transformer_blocks:
            x = block(x + context)
        for block in self.single_transformer_blocks:
            x = block(x)
        return self.proj_out(x)


def tiny_hunyuan(layer_groups: tuple[str, ...]) -> TinyHunyuan:
    """Seeded: the same weights whatever order the groups are declared in."""
    torch.manual_seed(0)
    return TinyHunyuan(layer_groups).eval()


def hunyuan_inputs(device: str = "cpu") -> dict:
    g = torch.Generator().manual_seed(1)
    return {"x": torch.randn(1, 5, 16, generator=g).to(device), "text": torch.randn(1, 3, 8, generator=g).to(device)}


def refiner_trace(model: nn.Module) -> None:
    """One forward of a TinyHunyuan on meta inputs: what the engine and planner trace the order with."""
    model(**hunyuan_inputs("meta"))
