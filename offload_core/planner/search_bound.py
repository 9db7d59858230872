"""Lower bounds on the plan a strategy combination can reach: the plan search's branch and bound.

``planner.search`` considers every combination of per-component strategies, and for each it tries grows
resident layers and prefetch windows (hundreds of cost-model evaluations). A combination whose plan provably
cannot be faster than the best feasible plan found so far is skipped, and combinations are tried
best bound first, so the search stops at the first bound that cannot win: the result is the
exhaustive search's, bit for bit (``bench/plan_equivalence.py`` shows it on every real model).

The bound per component holds whatever the search later decides (tiers, gates, windows, resident
layers up to what the weight budget allows), in the cost model's own terms (``planner.cost_model``):
- RESIDENT and MODEL_OFFLOAD: their prediction, which nothing else changes;
- LAYERWISE with ``r`` resident layers: each resident layer's host bytes copied once per request at the
  fastest tier's rate, plus per use the largest of its compute, the streamed layers' DMA at the
  pinned rate (every streamed byte crosses the link pinned: staged tiers only add a host memcpy) and
  the host memcpy of the streamed bytes the host lease cannot pin (pins go along the pin order
  within the lease, each beside the staging the layers after it would need);
  minimised over the resident counts the search may reach (the option's own, or any above it when
  the search adds residents) whose device bytes fit the budget beside the other components' least.
A combination fits only if every stage fits with each component at its least: else it has no feasible
plan at all. Run in the planning process (the CLI, a replica's start); pure arithmetic on the facts.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Sequence

from offload_core.buffers import landing_bytes, slot_count
from offload_core.host.tier import HostingTier
from offload_core.planner.cost_model import non_layer_device_bytes, predict, slot_region_bytes
from offload_core.planner.facts import ComponentProfile, LinkFacts, PipelineFacts
from offload_core.planner.host_tiers import suffix_staging
from offload_core.planner.pipeline_plan import ComponentOverride, ComponentPlan
from offload_core.planner.strategy import Strategy

# Bounds and predictions add the same seconds in different orders: a bound within this of the best
# time is not taken as proof (float error is ~1e-12 s at these magnitudes; plans compare at 1e-9 s).
MARGIN_S = 1e-6


@dataclass(frozen=True)
class OptionBound:
    """What one component's option costs at least: device bytes in its stage and outside it, and per
    reachable resident count its least device bytes in use and its least seconds per request."""

    idle_bytes: int
    in_use_bytes: tuple[int, ...]  # per reachable resident count, ascending counts
    time_s: tuple[float, ...]  # the same counts' least seconds

    @property
    def least_in_use(self) -> int:
        return min(self.in_use_bytes)

    def least_time(self, cap: float) -> float:
        """The least seconds over resident counts whose bytes in use fit ``cap`` (inf: none fits)."""
        return min((t for b, t in zip(self.in_use_bytes, self.time_s) if b <= cap), default=math.inf)


def fillable(profile: ComponentProfile, overrides: Mapping[str, ComponentOverride]) -> bool:
    """Whether the search adds resident layers to the component when it streams: used more than once
    per request (a layer kept saves a copy per use) and its resident count not pinned by hand."""
    return overrides.get(profile.name, ComponentOverride()).resident_layers is None and profile.uses_per_request > 1


def pin_room(facts: PipelineFacts, profile: ComponentProfile, overrides: Mapping[str, ComponentOverride]) -> int | None:
    """The most host bytes the component's layers can be pinned in: the lease, unless its tiers are
    pinned by hand (``host_tiers.tiers_along_pin_order`` pins within the lease only what it chooses)."""
    return None if overrides.get(profile.name, ComponentOverride()).hosting is not None else facts.host_lease_bytes


def _least_staged(layers, r: int, pin_room: int) -> int:
    """The fewest streamed host bytes left staged with ``r`` layers resident: pins go along the
    component's claim (streamed layers, then resident ones) while each pin and the staging the
    layers after it would need fit the lease (``host_tiers.tiers_along_pin_order``; what other
    components took first only leaves less), and stop at the first that does not."""
    claim = (*layers[r:], *layers[:r])
    after = suffix_staging(tuple(layer.layout.host_flat_bytes for layer in claim))
    pinned = 0
    for i, layer in enumerate(layers[r:]):
        if pinned + layer.host_bytes + after[i + 1] > pin_room:
            break
        pinned += layer.host_bytes
    return sum(layer.host_bytes for layer in layers[r:]) - pinned


def component_bounds(profile: ComponentProfile, options: Sequence[ComponentPlan], link: LinkFacts, filled: bool,
                     pin_room: int | None) -> list[OptionBound]:
    """Each option's bound; ``filled``: the search may add resident layers (``search._fill_residents``, ``fillable``);
    ``pin_room``: the most host bytes its layers can be pinned in (the host lease; None: its tiers are
    pinned by hand)."""
    layers, n = profile.layers, len(profile.layers)
    landing = landing_bytes(layer.layout for layer in layers)
    fastest = max(link.rate(tier) for tier in HostingTier)
    compute, uses = profile.compute_s_per_use, profile.uses_per_request
    per_count = {}  # resident count -> (resident bytes, one slot's bytes, seconds per request at least)

    def at(r: int):
        if r not in per_count:
            streamed = layers[r:]
            streamed_bytes = sum(layer.host_bytes for layer in streamed)
            staged = 0 if pin_room is None or not streamed else _least_staged(layers, r, pin_room)
            once = sum(layer.host_bytes for layer in layers[:r]) / fastest
            per_use = max(compute, streamed_bytes / link.pinned_Bps, staged / link.rate(HostingTier.PAGEABLE))
            per_count[r] = (sum(layer.nbytes for layer in layers[:r]), slot_region_bytes(streamed) if streamed else 0,
                            once + uses * per_use)
        return per_count[r]

    out = []
    for plan in options:
        if plan.strategy is not Strategy.LAYERWISE:
            p = predict(profile, plan, link, False)  # no tiers, no gate, no window: the prediction is the plan's
            out.append(OptionBound(p.idle_bytes, (p.in_use_bytes,), (p.time_s,)))
            continue
        first = min(plan.resident_layers, n)
        rest = non_layer_device_bytes(profile, plan)
        in_use, times = [], []
        for r in (range(first, n + 1) if filled else (first,)):
            resident, slot, seconds = at(r)
            # the window never narrows below the option's depth (the search only widens it)
            in_use.append(rest + resident + slot_count(plan.prefetch_depth, n - r) * slot + landing)
            times.append(seconds)
        # parked between uses (a gate the search predicts later): nothing idle; otherwise its non-layer bytes
        out.append(OptionBound(0 if plan.park else rest, tuple(in_use), tuple(times)))
    return out


def combination_time_bound(facts: PipelineFacts, bounds: Sequence[OptionBound], budget: int) -> float:
    """The least seconds per request any feasible plan of this combination can predict (inf: none fits
    ``budget``). ``bounds`` in ``facts.components`` order."""
    names = [p.name for p in facts.components]
    caps = [math.inf] * len(names)  # a component in no stage is never in use beside the others
    for stage in facts.stages:
        inside = [i for i, name in enumerate(names) if name in stage.components]
        least = (sum(bounds[i].least_in_use for i in inside)
                 + sum(b.idle_bytes for i, b in enumerate(bounds) if i not in inside))
        if least > budget:
            return math.inf
        for i in inside:  # the room left to this component while its stage runs, the others at their least
            caps[i] = min(caps[i], budget - (least - bounds[i].least_in_use))
    return sum(b.least_time(cap) for b, cap in zip(bounds, caps))
