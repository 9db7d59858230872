"""Projection: FLUX.1-dev images per hour at batch 1, 2, 4, 8, streamed on an RTX 4090, resident on an L40S.

Runs on the simulated accelerator (``testing.sim``): the engine streams a stand-in
model with FLUX.1-dev's real layer structure (19 double-stream + 38 single-stream blocks, each
layer's bytes in proportion to the real bf16 layer's, read on ``meta``), the link is scaled by the
same factor, and each layer is charged its real compute time for the batch. So the simulated step
is the real step's timing under CUDA's copy and stream rules, with real-size bytes and FLOPs.

Facts: 512x512 (1,024 image tokens + 512 text tokens), 28 steps, guidance as an embedding (one
forward per step); PCIe Gen4 pinned 25 GB/s; compute 2 FLOPs per parameter per token at 40 % of
the vendor's dense bf16 rate (the planner's figures: 165 TFLOP/s RTX 4090, 362 L40S); attention's
quadratic term and the text encoders and VAE are left out (a lower bound on compute).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import nn

from offload_core.host.tier import HostingTier
from offload_core.planner.facts import profile_component
from offload_core.planner.gpus import gpu_model, link_Bps
from offload_core.planner.inputs import SUSTAINED_FRACTION
from offload_core.planner.real_models import meta_component
from offload_core.streaming.engine import StreamingConfig, apply_layer_streaming
from testing.sim import SimDevice, SimLink

MODEL, STEPS, IMAGE_TOKENS, TEXT_TOKENS = "flux.1-dev", 28, (512 // 16) ** 2, 512
PINNED_BPS = link_Bps(4, 16)[0]  # PCIe Gen4 x16, from the one GPU table (25 GB/s)
STANDIN_DIM, STANDIN_UNIT = 16, 32  # the smallest real layer becomes Linear(16, 32) twice


class StandIn(nn.Module):
    """One tiny layer per real layer; layer i's hidden width is proportional to its real bytes."""

    offload_layer_groups = ("blocks",)

    def __init__(self, widths: list[int]):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(STANDIN_DIM, w, bias=False), nn.ReLU(),
                                                  nn.Linear(w, STANDIN_DIM, bias=False)) for w in widths)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return x


@dataclass(frozen=True)
class Projection:
    batch: int
    step_s: float
    images_per_hour: float
    copy_s: float  # transfer per step (every layer once)
    compute_s: float  # compute per step for the batch


def flux_layers() -> tuple[list[int], list[int], int]:
    """(bytes, params) per real layer in execution order, and the non-layer bytes, in bf16."""
    profile = profile_component("transformer", meta_component(MODEL, "transformer"), uses_per_request=STEPS)
    return [layer.nbytes for layer in profile.layers], [layer.params for layer in profile.layers], profile.non_layer_bytes


def simulate_streamed(layer_bytes: list[int], layer_params: list[int], batch: int, flops: float) -> Projection:
    smallest = min(layer_bytes)
    widths = [max(1, round(STANDIN_UNIT * b / smallest)) for b in layer_bytes]
    model = StandIn(widths).eval()
    standin_bytes = [2 * STANDIN_DIM * w * 4 for w in widths]  # two fp32 weights per layer
    scale = sum(standin_bytes) / sum(layer_bytes)  # the link slows by the same factor the bytes shrink
    device = SimDevice(SimLink(pinned_Bps=PINNED_BPS * scale))
    keys = [f"blocks.{i}" for i in range(len(widths))]
    streamer = apply_layer_streaming(model, device, StreamingConfig(
        prefetch_depth=1, hosting={k: HostingTier.PINNED for k in keys}))
    device.register_streamer(streamer)
    tokens = (IMAGE_TOKENS + TEXT_TOKENS) * batch
    compute = {k: 2.0 * p * tokens / flops for k, p in zip(keys, layer_params)}
    device.charge_layer_compute(streamer, compute)
    streamer.prepare_for_use()
    x, ends = torch.zeros(1, STANDIN_DIM), []
    with torch.no_grad():
        for _ in range(3):  # the third step is steady state: the pipeline is full
            model(x)
            device.synchronize()
            ends.append(device.now)
    streamer.remove()
    step = ends[-1] - ends[-2]
    return Projection(batch, step, 3600 * batch / (STEPS * step), sum(layer_bytes) / PINNED_BPS, sum(compute.values()))


def resident(layer_params: list[int], batch: int, flops: float) -> Projection:
    compute = sum(2.0 * p * (IMAGE_TOKENS + TEXT_TOKENS) * batch / flops for p in layer_params)
    return Projection(batch, compute, 3600 * batch / (STEPS * compute), 0.0, compute)


def project(batches=(1, 2, 4, 8)) -> dict:
    layer_bytes, layer_params, non_layer = flux_layers()
    rtx4090 = gpu_model("RTX4090").dense_bf16_flops * SUSTAINED_FRACTION
    l40s = gpu_model("L40S").dense_bf16_flops * SUSTAINED_FRACTION
    streamed = [simulate_streamed(layer_bytes, layer_params, b, rtx4090) for b in batches]
    kept = [resident(layer_params, b, l40s) for b in batches]
    return {"model": MODEL, "steps": STEPS, "tokens_per_image": IMAGE_TOKENS + TEXT_TOKENS,
            "layers": len(layer_bytes), "layer_bytes": sum(layer_bytes), "non_layer_bytes": non_layer,
            "weights_gib": round((sum(layer_bytes) + non_layer) / 2**30, 2),
            "rtx4090_streamed": [dataclasses.asdict(p) for p in streamed],
            "l40s_resident": [dataclasses.asdict(p) for p in kept]}


def print_projection(result: dict) -> None:
    print(f"\nprojection (simulated accelerator): {result['model']}, {result['layers']} layers, "
          f"{result['weights_gib']} GiB bf16, 512x512, {result['steps']} steps")
    print(f"{'batch':>5} {'4090 streamed s/step':>21} {'images/h':>9} {'copy s':>7} {'compute s':>9} "
          f"{'L40S resident s/step':>21} {'images/h':>9}")
    for s, r in zip(result["rtx4090_streamed"], result["l40s_resident"]):
        print(f"{s['batch']:>5} {s['step_s']:>21.3f} {s['images_per_hour']:>9.0f} {s['copy_s']:>7.3f} "
              f"{s['compute_s']:>9.3f} {r['step_s']:>21.3f} {r['images_per_hour']:>9.0f}")
