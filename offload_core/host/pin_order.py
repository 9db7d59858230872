"""The pin order: which streamed layers are offered page-locked host memory first.

One function for the planner (which predicts the tiers) and the host-memory plan (which leases
them), so the tiers a plan predicts are the tiers the host is asked for. Components are ranked by
the bytes they would move per request if nothing were resident (layer bytes x uses per request: a
denoiser used 50 times outranks a bigger encoder used once, since a pin saves a copy per use);
within a component, streamed layers come first in execution order, then resident ones (copied at
most once per request, so a pin saves them the least).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable


@dataclass(frozen=True)
class PinClaim:
    """One component's claim on pins: its layers, each with the host bytes a pin would take."""

    component: str
    uses_per_request: int
    streamed: tuple[tuple[str, int], ...]  # (layer key, host bytes), in execution order
    resident: tuple[tuple[str, int], ...] = ()  # (layer key, host bytes) of its resident layers

    @property
    def priority(self) -> int:
        """Bytes moved per request if streamed: what a pin saves, per byte pinned, is proportional."""
        return sum(n for _, n in self.streamed + self.resident) * self.uses_per_request

    @property
    def layers(self) -> tuple[tuple[str, int], ...]:
        """The component's layers in the order it offers them pins."""
        return self.streamed + self.resident


def pin_order(claims: Iterable[PinClaim]) -> tuple[PinClaim, ...]:
    """Claims in the order pins are offered: highest priority first, ties in the order given."""
    return tuple(sorted(claims, key=lambda claim: claim.priority, reverse=True))


__all__ = ["PinClaim", "pin_order"]
