"""Encoded prompts of the families whose encoders return more than ``EncodedPrompt``'s three tensors.

SD3.5 returns a negative pooled embedding too; Qwen-Image and HunyuanVideo 1.5 return attention masks
(HunyuanVideo 1.5 a second, glyph, embedding with its own mask); Z-Image returns one embedding per
prompt of its own length. Each family declares a frozen dataclass of exactly its tensors on this
base, so the encoder stage, Ray's object store and the Denoiser carry it like ``EncodedPrompt``
(``to``, ``packed``, ``unpacked``). No packing: these encoders' outputs carry no all-zero padding
rows to drop (T5 and Qwen give every pad token a non-zero row; masks say which rows count).
Built by the encoder stage, read by the Denoiser (and the activation calibration of both).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch


def _move(value, device: torch.device):
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, tuple):  # Z-Image: one tensor per prompt row
        return tuple(_move(v, device) for v in value)
    return value


@dataclass(frozen=True)
class PromptTensors:
    """Base of a family's encoded prompt: its fields are tensors, tuples of tensors, or None."""

    def to(self, device: torch.device):
        return dataclasses.replace(self, **{f.name: _move(getattr(self, f.name), device)
                                            for f in dataclasses.fields(self)})

    def packed(self):
        return self

    def unpacked(self):
        return self
