"""A deep window over staged layers: the launch thread launches the layers banked ahead instead of
waiting for a fill it does not need yet (simulated accelerator, virtual clock)."""
from __future__ import annotations

import torch
from torch import nn

from offload_core.host.tier import HostingTier
from offload_core.streaming.engine import StreamingConfig, apply_layer_streaming
from testing.sim import SimDevice, SimLink

LINK = SimLink(pinned_Bps=25e9, pageable_Bps=10e9, mapped_Bps=10e9, host_memcpy_Bps=12e9)
LAYERS = 24


class Stack(nn.Module):
    """FLUX-like: the first third of the blocks twice the bytes of the rest."""

    offload_layer_groups = ("blocks",)

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(*(nn.Linear(64, 64) for _ in range(2 if i < LAYERS // 3 else 1)))
                                    for i in range(LAYERS))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def test_a_deep_window_over_staged_layers_keeps_launching_while_the_copier_catches_up(remove_after):
    torch.manual_seed(0)
    model, x = Stack().eval(), torch.randn(2, 64)
    with torch.no_grad():
        expected = model(x)
    sim = SimDevice(LINK)
    keys = [f"blocks.{i}" for i in range(LAYERS)]
    streamer = remove_after(apply_layer_streaming(model, sim, StreamingConfig(
        prefetch_depth=6, hosting={k: HostingTier.PAGEABLE for k in keys})))
    sim.register_streamer(streamer)
    # Every layer computes the mean memcpy: the double blocks are copy-bound, the single ones compute-bound.
    memcpy = {layer.key: layer.layout.nbytes / LINK.host_memcpy_Bps for layer in streamer.layers}
    mean = sum(memcpy.values()) / LAYERS
    sim.charge_layer_compute(streamer, {key: mean for key in memcpy})
    streamer.prepare_for_use()
    ends = [0.0]
    with torch.no_grad():
        for _ in range(3):
            assert torch.equal(model(x), expected)
            sim.synchronize()
            ends.append(sim.now)
    bound = max(sum(memcpy.values()), mean * LAYERS) + max(memcpy.values())
    # 0.97 of the bound; waiting at each exit for the fill 6 layers ahead kept the banked layers
    # unlaunched (the copier's catching up on the critical path): 1.076.
    ratio = (ends[-1] - ends[-2]) / bound
    assert ratio < 1.03, ratio
