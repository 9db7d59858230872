"""The per-layer hosting plan: which streamed layers are PINNED, PAGEABLE or left MAPPED.

Pinned layers copy to the device asynchronously at full link speed (a Wan2.1 step: 1.03 s pinned
vs 1.90 s pageable), but pinned and pageable copies are anonymous memory the node must hold, and
the node's RAM is shared. The rules, each pinned by a test:

- Pins are offered in *pin order* (``host.pin_order``, the planner's too): components ranked by
  host bytes x uses per request (a denoiser runs ``num_inference_steps`` times per request, an
  encoder or decoder once; a missing uses figure is an error, never a silent fallback to raw
  bytes), and within a component streamed layers first in streamed order, then resident ones
  (copied at most once per request).
- The cost is the NET anonymous cost: only bytes copied out of a file mapping into anonymous
  memory count (plus the flat buffer's 512 B alignment padding). Consolidating an
  already-anonymous layer (e.g. a fused qkv) frees the original, so it is a wash.
- A component with PAGEABLE or MAPPED layers also holds pinned staging buffers (the engine copies
  those layers through them, ``streaming/staging.py``): ``buffers.staging_bytes`` of its staged
  layers, part of its net cost. Giving a pin back can add them; the fit recounts them each time.
  How many: ``HostingPolicy.staging`` per component (the planner's, wider for an uneven stack),
  else ``staging_buffers``; a short host narrows a wider ring back to the default first.
- The plan asks the budget for ONE lease for its whole net cost: asking per tier would test each
  tier against the same free bytes and so double-charge them.
- If the cost does not fit: demote unpinned (pageable) mapping-backed layers to MAPPED, tail of
  the pin order first; then give pins back from the tail until it fits. Never over-commit: the
  lease is granted or the plan shrinks to what the ledger says is free.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Mapping, Sequence

from offload_core.buffers import DEFAULT_STAGING_BUFFERS, staging_bytes
from offload_core.host.budget import Lease, MemoryBudget, Refusal
from offload_core.host.on_host import ComponentOnHost, LayerOnHost
from offload_core.host.pin_order import pin_order
from offload_core.host.tier import STAGED_TIERS, HostingTier

logger = logging.getLogger(__name__)

GiB = 1024**3
# Another replica may take bytes between our look at `available()` and our request; each refusal
# re-fits the plan to the figure it reports. Five rounds is far more than two replicas racing need;
# the last round asks for nothing copied, which any ledger grants.
_MAX_REQUEST_ROUNDS = 5


class HostingError(RuntimeError):
    """No hosting plan fits the host: not even its floor (the staging buffers) can be leased."""


@dataclass(frozen=True)
class ComponentHosting:
    """The plan for one component: a tier per layer key, the bytes per tier, and why."""

    name: str
    rank: int  # 1 = offered pins first
    priority: int  # weight bytes x uses per request
    tiers: tuple[tuple[str, HostingTier], ...]
    pinned_bytes: int
    pageable_bytes: int
    mapped_bytes: int
    net_cost: int  # anonymous bytes this plan adds for the component (staging included)
    reason: str
    staging_bytes: int = 0  # pinned staging buffers for its PAGEABLE and MAPPED layers
    staging_buffers: int = DEFAULT_STAGING_BUFFERS  # how many (the policy's, or the default if narrowed to fit)


    def tiers_for(self) -> dict[str, HostingTier]:
        return dict(self.tiers)

    def count(self, tier: HostingTier) -> int:
        return sum(1 for _, t in self.tiers if t is tier)

    def log_line(self) -> str:
        c = {t: self.count(t) for t in HostingTier}
        return (f"hosting {self.name}: {c[HostingTier.PINNED]} pinned ({_gib(self.pinned_bytes)}), "
                f"{c[HostingTier.PAGEABLE]} pageable ({_gib(self.pageable_bytes)}), "
                f"{c[HostingTier.MAPPED]} mapped ({_gib(self.mapped_bytes)}), staging "
                f"{_gib(self.staging_bytes)} pinned, net anonymous cost "
                f"{_gib(self.net_cost)}; {self.reason}")


@dataclass(frozen=True)
class HostingPlan:
    """Tiers for every component of a replica, and the one lease that pays for them."""

    components: tuple[ComponentHosting, ...]
    lease: Lease
    net_cost: int
    available: int  # what the ledger had free when the plan was fitted
    reasons: tuple[str, ...]

    def component(self, name: str) -> ComponentHosting:
        for c in self.components:
            if c.name == name:
                return c
        raise KeyError(f"no component {name!r} in the hosting plan (have {[c.name for c in self.components]})")

    def tiers_for(self, name: str) -> dict[str, HostingTier]:
        """Layer key -> tier, ready for the engine's StreamingConfig.hosting."""
        return self.component(name).tiers_for()

    def release(self, budget: MemoryBudget) -> None:
        """Give the plan's lease back; call once the layers' host buffers are freed."""
        budget.release(self.lease)


@dataclass
class _Slot:
    """A layer's place in the pin order while the plan is being fitted."""

    component: ComponentOnHost
    layer: LayerOnHost
    tier: HostingTier
    wanted: HostingTier  # before the host was consulted, for the log's "why"
    staging_buffers: int  # the policy's, carried so a slot list alone prices its staging

    @property
    def cost(self) -> int:
        return 0 if self.tier is HostingTier.MAPPED else self.layer.consolidation_cost


@dataclass(frozen=True)
class HostingPolicy:
    """What a replica wants before the host is consulted."""

    # The best tier any layer may get: PINNED (pin along the pin order), PAGEABLE (pin nothing,
    # e.g. a host whose driver refuses to lock more), MAPPED (copy nothing: memory mode).
    ceiling: HostingTier = HostingTier.PINNED
    # Cap on gross pinned bytes (e.g. what the driver lets one process lock); None: no cap.
    max_pinned_bytes: int | None = None
    purpose: str = "host-weights"  # written on the lease, for the ledger's reports
    # Per component, per layer key: the best tier a planner wants for that layer (a performance
    # mode may want resident layers pageable, say); layers not named get ``ceiling``.
    wanted: Mapping[str, Mapping[str, HostingTier]] | None = None
    # Pinned staging buffers the engine keeps per component with PAGEABLE or MAPPED layers
    # (StreamingConfig.staging_buffers); 0: the engine runs with staged_copies=False.
    staging_buffers: int = DEFAULT_STAGING_BUFFERS
    # Per component, more staging buffers than ``staging_buffers`` (the planner's, for an uneven
    # stack: planner.staging_ring); narrowed back to ``staging_buffers`` first when the host is short.
    staging: Mapping[str, int] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.ceiling, HostingTier):
            raise TypeError(f"ceiling must be a HostingTier, got {self.ceiling!r}")
        wanted = {c: dict(tiers) for c, tiers in (self.wanted or {}).items()}
        bad = [(c, k, t) for c, tiers in wanted.items() for k, t in tiers.items() if not isinstance(t, HostingTier)]
        if bad:
            raise TypeError(f"wanted tiers must be HostingTier values, got {bad[:3]}")
        object.__setattr__(self, "wanted", wanted)  # a private copy: the caller's dicts may change
        if self.max_pinned_bytes is not None and self.max_pinned_bytes < 0:
            raise ValueError(f"max_pinned_bytes must be >= 0, got {self.max_pinned_bytes}")
        if isinstance(self.staging_buffers, bool) or not isinstance(self.staging_buffers, int) or self.staging_buffers < 0:
            raise ValueError(f"staging_buffers must be an int >= 0, got {self.staging_buffers!r}")
        staging = dict(self.staging or {})
        bad = {c: n for c, n in staging.items() if isinstance(n, bool) or not isinstance(n, int) or n < 1}
        if bad:
            raise ValueError(f"staging buffers per component must be ints >= 1, got {bad}")
        object.__setattr__(self, "staging", staging)

    def staging_for(self, component: str) -> int:
        return self.staging.get(component, self.staging_buffers)

    def best_tier(self, component: str, key: str) -> HostingTier:
        return self.wanted.get(component, {}).get(key, self.ceiling)

    def check_names(self, components: Sequence[ComponentOnHost]) -> None:
        """Wanted tiers for unknown components or layers are a caller's mistake, not a no-op."""
        keys = {c.name: {layer.key for layer in c.layers} for c in components}
        unknown = [(c, k) for c, tiers in self.wanted.items() for k in tiers if k not in keys.get(c, ())]
        if unknown:
            raise ValueError(f"wanted tiers name layers the facts do not have: {unknown[:4]}")


def plan_hosting(
    components: Sequence[ComponentOnHost],
    budget: MemoryBudget,
    owner: str,
    policy: HostingPolicy | None = None,
) -> HostingPlan:
    """Fit per-layer tiers to ``budget`` and take one lease for their net anonymous cost."""
    policy = policy or HostingPolicy()
    names = [c.name for c in components]
    if len(set(names)) != len(names):
        raise ValueError(f"component names must be unique, got {names}")
    policy.check_names(components)
    by_name = {c.name: c for c in components}
    ranked = [by_name[claim.component] for claim in pin_order(c.claim() for c in components)]
    slots = _wanted(ranked, policy)
    purpose = policy.purpose
    reasons: list[str] = []
    available = budget.available()
    for _ in range(_MAX_REQUEST_ROUNDS - 1):
        reasons.extend(_fit(slots, available))
        granted = _request(budget, slots, owner, ranked, purpose)
        if isinstance(granted, Lease):
            break
        reasons.append(f"ledger refused {_gib(granted.nbytes)} ({granted.reason}); refitting to "
                       f"{_gib(granted.available)}")
        available = granted.available
    else:
        reasons.extend(_fit(slots, 0))
        granted = _request(budget, slots, owner, ranked, purpose)
        if not isinstance(granted, Lease):
            # Only the staging buffers are left to pay for: the floor of any plan with a
            # pageable or mapped layer (2 x the largest such layer).
            raise HostingError(f"the host cannot hold even the pinned staging buffers ({_gib(_staging(slots))}) "
                               f"with every layer left mapped: {granted.reason}, {_gib(granted.available)} free")
    plan = HostingPlan(tuple(_summarize(c, i + 1, slots, available) for i, c in enumerate(ranked)),
                       granted, _cost(slots), available, tuple(reasons))
    for c in plan.components:
        logger.info(c.log_line())
    return plan


def _wanted(ranked: Sequence[ComponentOnHost], policy: HostingPolicy) -> list[_Slot]:
    """The tiers wanted before the host is consulted: pins along the pin order up to the cap."""
    slots, pinned, pin_open, cap = [], 0, True, policy.max_pinned_bytes
    for comp in ranked:
        layers = {layer.key: layer for layer in comp.layers}
        for layer in (layers[key] for key, _ in comp.claim().layers):
            best = policy.best_tier(comp.name, layer.key)
            if best is HostingTier.PINNED and pin_open and (cap is None or pinned + layer.host_bytes <= cap):
                tier, pinned = HostingTier.PINNED, pinned + layer.host_bytes
            else:
                # The pin order is a priority order: once one layer misses the cap, later ones
                # do not jump ahead of it.
                pin_open = pin_open and best is not HostingTier.PINNED
                copy_nothing = best is HostingTier.MAPPED and layer.mapped_bytes > 0 and not layer.quantized
                tier = HostingTier.MAPPED if copy_nothing else HostingTier.PAGEABLE
            slots.append(_Slot(comp, layer, tier, tier, policy.staging_for(comp.name)))
    return slots


def _fit(slots: list[_Slot], available: int) -> list[str]:
    """Narrow widened staging rings to the default, then demote pageable layers to mapped, then give
    pins back, tail of the pin order first (a wider ring only shortens waits; a tier moves bytes).

    Each move is recounted in full: a pin given back may add its component's staging buffers.
    """
    reasons = []
    cost = _cost(slots)
    wide = sorted({s.component.name for s in slots if s.staging_buffers > DEFAULT_STAGING_BUFFERS})
    if cost > available and wide:
        for slot in slots:
            slot.staging_buffers = min(slot.staging_buffers, DEFAULT_STAGING_BUFFERS)
        reasons.append(f"narrowed the staging rings of {', '.join(wide)} to {DEFAULT_STAGING_BUFFERS} buffers, "
                       f"to fit {_gib(available)} free ({_gib(cost)} wanted)")
        cost = _cost(slots)
    for from_tier in (HostingTier.PAGEABLE, HostingTier.PINNED):
        moved = 0
        for slot in reversed(slots):
            if cost <= available:
                break
            if slot.tier is from_tier and slot.cost > 0 and not slot.layer.quantized:  # FP8: never MAPPED
                slot.tier = HostingTier.MAPPED
                cost = _cost(slots)
                moved += 1
        if moved:
            verb = "demoted pageable layers to mapped" if from_tier is HostingTier.PAGEABLE else "gave back pins"
            reasons.append(f"{verb}: {moved} layers, to fit {_gib(available)} free")
    fp8 = sum(s.cost for s in slots if s.layer.quantized)
    if cost > available and fp8 and all(s.cost == 0 or s.layer.quantized for s in slots):
        raise HostingError(f"FP8 layers must be held in anonymous memory ({_gib(fp8)} of their 8-bit buffers), "
                           f"and {_gib(cost)} does not fit {_gib(available)} free: host fewer FP8 stages or "
                           "raise the host budget")
    assert cost <= available or all(s.cost == 0 for s in slots), "fit left a cost no demotion can cut"
    return reasons


def _staging(slots: Sequence[_Slot]) -> int:
    """Staging bytes of every component with a PAGEABLE or MAPPED layer (the engine's exact figure)."""
    staged: dict[str, list[tuple[tuple[str, int], ...]]] = {}
    buffers: dict[str, int] = {}
    for slot in slots:
        if slot.tier in STAGED_TIERS:
            staged.setdefault(slot.component.name, []).append(slot.layer.layout_bytes)
            buffers[slot.component.name] = slot.staging_buffers
    return sum(staging_bytes(layouts, buffers[name]) for name, layouts in staged.items())


def _cost(slots: Sequence[_Slot]) -> int:
    return sum(s.cost for s in slots) + _staging(slots)


def _request(budget: MemoryBudget, slots: list[_Slot], owner: str,
             ranked: Sequence[ComponentOnHost], purpose: str) -> Lease | Refusal:
    cost = _cost(slots)
    priority = float(ranked[0].priority) if ranked else 0.0
    return budget.request(cost, owner, priority=priority, purpose=purpose)


def _summarize(comp: ComponentOnHost, rank: int, slots: list[_Slot], available: int) -> ComponentHosting:
    mine = [s for s in slots if s.component is comp]
    by_tier = {t: sum(s.layer.nbytes if t is HostingTier.MAPPED else s.layer.host_bytes
                      for s in mine if s.tier is t) for t in HostingTier}
    given_back = sum(1 for s in mine if s.wanted is HostingTier.PINNED and s.tier is HostingTier.MAPPED)
    left_mapped = sum(1 for s in mine if s.wanted is HostingTier.PAGEABLE and s.tier is HostingTier.MAPPED)
    why = f"rank {rank} ({_gib(comp.weight_bytes)} x {comp.uses_per_request} uses/request); "
    if given_back or left_mapped:
        why += (f"host has {_gib(available)} free for the whole plan: {given_back} pins given back and "
                f"{left_mapped} pageable layers left mapped, from the tail of the pin order")
    else:
        why += f"everything wanted fits the {_gib(available)} free"
    staging = _staging(mine)
    return ComponentHosting(comp.name, rank, comp.priority, tuple((s.layer.key, s.tier) for s in mine),
                            by_tier[HostingTier.PINNED], by_tier[HostingTier.PAGEABLE],
                            by_tier[HostingTier.MAPPED], sum(s.cost for s in mine) + staging, why, staging,
                            mine[0].staging_buffers if mine else DEFAULT_STAGING_BUFFERS)


def _gib(nbytes: int) -> str:
    return f"{nbytes / GiB:.2f} GiB"
