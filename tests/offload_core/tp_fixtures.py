"""Tensor-parallel models for tests: tiny T5-family encoders, and a fake process group of N ranks.

The fake group (torch's own test backend) makes a world of N ranks inside one process: no
collective runs, so outputs are wrong, but every parameter is a real DTensor with this rank's
local shard. That is what byte counts and the engine's rules read, in milliseconds.
"""
from __future__ import annotations

import torch


def tiny_umt5(vocab: int = 4096, heads: int = 4):
    from transformers import UMT5Config, UMT5EncoderModel

    torch.manual_seed(0)
    cfg = UMT5Config(vocab_size=vocab, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=heads,
                     feed_forward_proj="gated-gelu")
    return UMT5EncoderModel(cfg).eval()


def tiny_t5(vocab: int = 4096):
    from transformers import T5Config, T5EncoderModel

    torch.manual_seed(1)
    cfg = T5Config(vocab_size=vocab, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                   feed_forward_proj="relu")
    return T5EncoderModel(cfg).eval()


def fake_world(world: int = 2):
    """A fake process group of ``world`` ranks in this process (this one is rank 0); yields its CPU mesh."""
    from offload_core.tensor_parallel.plans import planning_world

    return planning_world(world)


def sharded(model, mesh):
    """``model`` with its class's tensor-parallel plan applied over ``mesh`` (DTensor parameters)."""
    from offload_core.tensor_parallel.plans import divide_attention_heads, shard_in_place, tp_plan_for

    shard_in_place(model, mesh, tp_plan_for(type(model).__name__, model.config))
    divide_attention_heads(model, mesh.size(), mesh.get_local_rank())
    return model
