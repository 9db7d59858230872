"""Host tiers per layer for a candidate plan: which streamed layers the host lease pins.

Pins go along the pin order (``host.pin_order``, as the host plan leases them) while each pin and
the staging buffers the layers after it would need (its own component's and every component offered
pins after it) still fit the lease; the rest is PAGEABLE. The
search (``planner.search``) assigns them for every combination it tries and its bound
(``planner.search_bound``) reasons with the same rule. Runs in whichever process plans.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Mapping

from offload_core.buffers import DEFAULT_STAGING_BUFFERS, staging_bytes
from offload_core.host.pin_order import PinClaim, pin_order
from offload_core.host.tier import STAGED_TIERS, HostingTier
from offload_core.planner.facts import ComponentProfile, PipelineFacts
from offload_core.planner.pipeline_plan import ComponentOverride, ComponentPlan
from offload_core.planner.strategy import Strategy


def assign_hosting(facts: PipelineFacts, plans: dict[str, ComponentPlan],
                   overrides: Mapping[str, ComponentOverride], cache: dict | None = None) -> dict[str, ComponentPlan]:
    """Tiers per layer: pins along the pin order (``host.pin_order``, as the host plan leases them) up to the lease.

    A layer is pinned only if the lease also holds the staging buffers the layers after it would
    need if none of them were pinned, in its component and in the components offered pins later;
    what a component stages is taken from the lease at its end.
    The tiers depend only on which components stream and how many layers each keeps resident, so
    within one search (``cache``) they are worked out once per such combination.
    """
    key = ("hosting", tuple((n, p.strategy is Strategy.LAYERWISE, p.resident_layers) for n, p in plans.items()))
    if cache is not None and key in cache:
        return {n: dataclasses.replace(p, hosting=cache[key][n]) if n in cache[key] else p for n, p in plans.items()}
    out = tiers_along_pin_order(facts, plans, overrides)
    if cache is not None:
        cache[key] = {n: p.hosting for n, p in out.items() if p.hosting}
    return out


def tiers_along_pin_order(facts: PipelineFacts, plans: dict[str, ComponentPlan],
                          overrides: Mapping[str, ComponentOverride]) -> dict[str, ComponentPlan]:
    claims = []
    for profile in facts.components:
        if plans[profile.name].strategy is Strategy.LAYERWISE:
            r = min(plans[profile.name].resident_layers, len(profile.layers))
            claims.append(PinClaim(profile.name, profile.uses_per_request,
                                   tuple((l.key, l.host_bytes) for l in profile.layers[r:]),
                                   tuple((l.key, l.host_bytes) for l in profile.layers[:r])))
    left, pin_open, out = facts.host_lease_bytes, True, dict(plans)
    ordered = pin_order(claims)
    layouts = {c.component: {l.key: l.layout.host_flat_bytes for l in facts.component(c.component).layers}
               for c in ordered}
    afters = [suffix_staging(tuple(layouts[c.component][key] for key, _ in c.layers)) for c in ordered]
    staged_later = _staging_of_later_claims(ordered, afters, overrides)
    for rank, claim in enumerate(ordered):
        plan, profile = plans[claim.component], facts.component(claim.component)
        forced = overrides.get(claim.component, ComponentOverride()).hosting
        tiers = {}
        keys, after = [key for key, _ in claim.layers], afters[rank]
        for index, (key, nbytes) in enumerate(claim.layers):
            if forced is not None:
                tiers[key] = forced
            elif pin_open and nbytes + after[index + 1] + staged_later[rank] <= left:
                tiers[key], left = HostingTier.PINNED, left - nbytes
            else:
                pin_open = False  # a priority order: later layers do not jump ahead of a missed one
                tiers[key] = HostingTier.PAGEABLE
        left -= staging_bytes(layouts[claim.component][key] for key in keys if tiers[key] in STAGED_TIERS)
        out[claim.component] = dataclasses.replace(plan, hosting=tuple((l.key, tiers[l.key]) for l in profile.layers))
    return out


def _staging_of_later_claims(ordered: tuple[PinClaim, ...], afters: list[list[int]],
                             overrides: Mapping[str, ComponentOverride]) -> list[int]:
    """``[k]``: the staging bytes the claims after the ``k``-th would hold if they were offered no pin
    (``afters[k][0]``: each claim's whole staging), so a pin never takes what they stage through
    (FLUX.1-dev, 24 GiB host: the transformer pinned 54 layers and left T5's two 448 MiB buffers 0.66 GiB
    over the lease). Offered pins later, a claim can only stage as much or less: a hand-pinned one stages
    nothing, one hand-set to another tier all of it."""
    staged = [0 if overrides.get(claim.component, ComponentOverride()).hosting is HostingTier.PINNED else after[0]
              for claim, after in zip(ordered, afters)]
    return [sum(staged[k + 1:]) for k in range(len(ordered))]


def pinned_bytes(profile: ComponentProfile, hosting, cache: dict | None) -> int:
    """Host bytes of the component's PINNED layers, memoized per hosting within one search (a search
    re-evaluates the same tiers tens of thousands of times: 2.9 M layer visits planning SD3.5-Large)."""
    key = ("pinned", profile.name, hosting)
    if cache is not None and key in cache:
        return cache[key]
    tiers = dict(hosting)
    nbytes = sum(layer.host_bytes for layer in profile.layers if tiers.get(layer.key) is HostingTier.PINNED)
    if cache is not None:
        cache[key] = nbytes
    return nbytes


@functools.lru_cache(maxsize=1024)  # one entry per (component, resident count): the search asks again and again
def suffix_staging(layouts: tuple) -> list[int]:
    """``[i]``: the staging bytes of layers ``i..`` (``buffers.staging_bytes``), for every i; ``[n]`` is 0."""
    out, largest = [0] * (len(layouts) + 1), {}
    for i in range(len(layouts) - 1, -1, -1):
        for dtype, nbytes in layouts[i]:
            largest[dtype] = max(largest.get(dtype, 0), nbytes)
        # the suffix's per-dtype largest stands for each of its layers: same buffers, same bytes; more
        # copies than buffers change nothing, so at most that many are passed (O(n), not O(n^2): 40
        # layers x 128 strategy combinations made this a third of planning Wan2.1-14B)
        out[i] = staging_bytes([tuple(largest.items())] * min(len(layouts) - i, DEFAULT_STAGING_BUFFERS))
    return out
