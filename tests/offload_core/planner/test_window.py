"""The planner's prefetch window: deep enough for an uneven stack to stay ahead, depth 1 for an even one."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from offload_core.host.tier import HostingTier
from offload_core.planner.facts import LinkFacts, PipelineFacts, Stage, profile_component
from offload_core.planner.search import ComponentOverride, PerformanceMode, plan_pipeline
from offload_core.planner.window import WINDOW_TOLERANCE, choose_window, replay_use_s

LINK = LinkFacts(pinned_Bps=25e9, pageable_Bps=10e9)
LAYERS = 40


class Block(nn.Module):
    def __init__(self, dim: int, linears: int):
        super().__init__()
        self.fcs = nn.ModuleList(nn.Linear(dim, dim) for _ in range(linears))

    def forward(self, x):
        for fc in self.fcs:
            x = fc(x)
        return x


class Stack(nn.Module):
    """FLUX-like when ``uneven``: the first third of the blocks carry twice the bytes."""

    offload_layer_groups = ("blocks",)

    def __init__(self, uneven: bool):
        super().__init__()
        self.blocks = nn.ModuleList(Block(64, 2 if uneven and i < LAYERS // 3 else 1) for i in range(LAYERS))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def profile(uneven: bool, uses: int = 4):
    """Every layer computes the mean layer's pinned copy: balanced overall, uneven per layer."""
    with torch.device("meta"):
        model = Stack(uneven)
    bare = profile_component("stack", model, uses_per_request=uses)
    mean = sum(layer.host_bytes for layer in bare.layers) / len(bare.layers) / LINK.pinned_Bps
    return profile_component("stack", model, uses_per_request=uses, compute_s_per_layer=[mean] * LAYERS)


def pinned(p):
    return {layer.key: HostingTier.PINNED for layer in p.layers}


def test_an_uneven_stack_needs_a_deeper_window_to_reach_its_bound_and_an_even_one_does_not():
    uneven, even = profile(uneven=True), profile(uneven=False)
    deep = choose_window(uneven.layers, pinned(uneven), LINK, uneven.compute_s_per_layer)
    assert deep.depth > 2, deep
    assert deep.shallow_use_s > 1.1 * deep.bound_s, "depth 1 should leave the double blocks' copies unbanked"
    assert deep.use_s <= (1 + WINDOW_TOLERANCE) * deep.bound_s
    flat = choose_window(even.layers, pinned(even), LINK, even.compute_s_per_layer)
    assert flat.depth == 1 and flat.wait_s == 0.0, flat


def test_the_replay_is_the_ring_reaching_max_copy_compute_for_equal_layers():
    sizes, copy, compute = (100,) * 8, (1.0,) * 8, (1.0,) * 8
    assert replay_use_s(sizes, 200, copy, compute) == pytest.approx(8.0)
    assert replay_use_s(sizes, 200, copy, (0.5,) * 8) == pytest.approx(8.0)  # copy-bound
    assert replay_use_s(sizes, 200, (0.5,) * 8, compute) == pytest.approx(8.0)  # compute-bound


def facts(p, capacity: int) -> PipelineFacts:
    return PipelineFacts((p,), (Stage("denoise", ("stack",)),), capacity, LINK, host_lease_bytes=1 << 34)


def test_auto_plans_the_window_that_stays_ahead_and_says_why():
    p = profile(uneven=True)
    # Room for a deep window, not for the whole stack: the plan streams, and widens its window.
    capacity = p.non_layer_bytes + p.layer_bytes // 2
    plan = plan_pipeline(facts(p, capacity), PerformanceMode.AUTO,
                         {"stack": ComponentOverride(resident_layers=0)})
    component = plan.component("stack")
    assert component.prefetch_depth > 2, plan.explain()
    assert component.prediction.window_wait_s <= WINDOW_TOLERANCE * component.prediction.window_bound_s
    assert "banks the copy-bound layers' copies ahead" in component.explain()
    shallow = plan_pipeline(facts(p, capacity), PerformanceMode.AUTO,
                            {"stack": ComponentOverride(resident_layers=0, prefetch_depth=1)})
    assert shallow.time_s_per_request > plan.time_s_per_request
    assert "too narrow for its uneven layers" in shallow.component("stack").explain()
