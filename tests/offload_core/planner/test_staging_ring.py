"""The planner's staging ring: wider for an uneven staged stack, two buffers for an even one or a short host."""
from __future__ import annotations

import torch

from offload_core.buffers import DEFAULT_STAGING_BUFFERS, RegionMap
from offload_core.host.tier import HostingTier
from offload_core.planner.facts import LinkFacts, PipelineFacts, Stage, profile_component
from offload_core.planner.search import ComponentOverride, PerformanceMode, plan_pipeline
from offload_core.planner.staging_ring import choose_staging
from offload_core.planner.window import choose_window
from offload_core.residency.components import streaming_config
from tests.offload_core.planner.test_window import LAYERS, Stack

# bench/sim_overlap.py's link: the host memcpy into staging (12 GB/s) is the copy's slow stage.
LINK = LinkFacts(pinned_Bps=25e9, pageable_Bps=10e9, staged_Bps=12e9)


def profile(uneven: bool):
    """Every layer computes the mean layer's staged copy: balanced overall, uneven per layer."""
    with torch.device("meta"):
        model = Stack(uneven)
    bare = profile_component("stack", model, uses_per_request=4)
    mean = sum(layer.host_bytes for layer in bare.layers) / len(bare.layers) / LINK.staged_Bps
    return profile_component("stack", model, uses_per_request=4, compute_s_per_layer=[mean] * LAYERS)


def pageable(p):
    return {layer.key: HostingTier.PAGEABLE for layer in p.layers}


def staging(p, depth=None):
    tiers = pageable(p)
    depth = depth or choose_window(p.layers, tiers, LINK, p.compute_s_per_layer).depth
    return choose_staging(p.layers, tiers, LINK, p.compute_s_per_layer, depth)


def test_an_uneven_staged_stack_needs_more_than_two_staging_buffers_and_an_even_one_does_not():
    wide = staging(profile(uneven=True))
    assert wide.buffers > DEFAULT_STAGING_BUFFERS, wide
    assert wide.default_use_s > 1.03 * wide.use_s, "two buffers should keep the double blocks' copies from banking"
    assert staging(profile(uneven=False)).buffers == DEFAULT_STAGING_BUFFERS


def test_nothing_staged_needs_no_staging_ring():
    p = profile(uneven=True)
    pinned = {layer.key: HostingTier.PINNED for layer in p.layers}
    assert choose_staging(p.layers, pinned, LINK, p.compute_s_per_layer, 4) is None


def plan(p, host_lease_bytes: int):
    facts = PipelineFacts((p,), (Stage("denoise", ("stack",)),), p.non_layer_bytes + p.layer_bytes // 2, LINK,
                          host_lease_bytes=host_lease_bytes)
    return plan_pipeline(facts, PerformanceMode.AUTO,
                         {"stack": ComponentOverride(resident_layers=0, hosting=HostingTier.PAGEABLE)})


def test_auto_widens_the_staging_ring_counts_its_pinned_bytes_and_says_why():
    p = profile(uneven=True)
    out = plan(p, 1 << 34)
    component = out.component("stack")
    largest = RegionMap.covering((layer.layout for layer in p.layers), host=True).nbytes
    assert component.staging_buffers == staging(p, component.prefetch_depth).buffers > DEFAULT_STAGING_BUFFERS
    assert out.staging_bytes == component.prediction.staging_bytes == component.staging_buffers * largest
    assert out.pinned_bytes == out.staging_bytes  # every layer pageable: the ring is all it page-locks
    assert f"{component.staging_buffers} buffers for its uneven layers" in component.explain(), component.explain()
    assert streaming_config(component).staging_buffers == component.staging_buffers  # what the engine runs


def test_a_short_host_lease_keeps_two_staging_buffers_and_the_plan_says_so():
    p = profile(uneven=True)
    largest = RegionMap.covering((layer.layout for layer in p.layers), host=True).nbytes
    out = plan(p, DEFAULT_STAGING_BUFFERS * largest + largest // 2)
    component = out.component("stack")
    assert component.staging_buffers == DEFAULT_STAGING_BUFFERS
    assert out.staging_bytes == DEFAULT_STAGING_BUFFERS * largest
    assert "the host lease is short" in component.explain(), component.explain()
