"""A bench's verdict: its targets and correctness checks, the ones it missed, and its exit status.

Runs in the bench's own process, at its end. Every bench that states a target ends through
:func:`finish`: one ``MISSED`` line per check that failed, ``"failed": [names]`` added to its JSON
object (still the last line printed), and exit status 1 when any missed, so a run in CI or a
device script fails instead of printing a number nobody reads.

``BENCH_TARGETS`` (a JSON object, e.g. ``{"overhead_ratio": 0}``) replaces the target of the named
checks: how the tests force a miss on a quick run, and how a slower machine loosens one knowingly
(the figure printed says which target it was held to).
"""
from __future__ import annotations

import enum
import json
import os
from dataclasses import dataclass

TARGETS_ENV = "BENCH_TARGETS"


class Kind(enum.Enum):
    AT_MOST = "<="
    AT_LEAST = ">="
    EQUAL = "=="


@dataclass(frozen=True)
class TargetCheck:
    name: str
    value: object
    kind: Kind
    target: object

    @property
    def missed(self) -> bool:
        if self.kind is Kind.AT_MOST:
            return not self.value <= self.target
        if self.kind is Kind.AT_LEAST:
            return not self.value >= self.target
        return self.value != self.target

    def describe(self) -> str:
        return f"{self.name} = {self.value!r} (target {self.kind.value} {self.target!r})"


def _overrides() -> dict:
    raw = os.environ.get(TARGETS_ENV, "")
    if not raw:
        return {}
    try:
        overrides = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise SystemExit(f"{TARGETS_ENV} is not JSON ({exc}): write e.g. '{{\"overhead_ratio\": 1.1}}'") from None
    if not isinstance(overrides, dict):
        raise SystemExit(f"{TARGETS_ENV} must be a JSON object of check name -> target, got {raw!r}")
    return overrides


def check(name: str, value: object, kind: Kind, target: object) -> TargetCheck:
    """One check; its target replaced by ``BENCH_TARGETS[name]`` when that names it."""
    return TargetCheck(name, value, kind, _overrides().get(name, target))


def at_most(name: str, value: float, target: float) -> TargetCheck:
    return check(name, value, Kind.AT_MOST, target)


def at_least(name: str, value: float, target: float) -> TargetCheck:
    """A figure that must not fall below its target (bench/mixed_fleet.py: throughput, ours / default)."""
    return check(name, value, Kind.AT_LEAST, target)


def equal(name: str, value: object, target: object) -> TargetCheck:
    """A correctness check (bitwise equal, peak == prediction): ``value`` must equal ``target``."""
    return check(name, value, Kind.EQUAL, target)


def finish(result: dict, checks: list[TargetCheck]) -> int:
    """Print the misses and ``result`` (with ``failed``) as the last line; the exit status (0 or 1)."""
    unknown = set(_overrides()) - {c.name for c in checks}
    if unknown:
        raise SystemExit(f"{TARGETS_ENV} names {sorted(unknown)}, which this bench does not check; "
                         f"its checks: {sorted(c.name for c in checks)}")
    missed = [c for c in checks if c.missed]
    for c in missed:
        print(f"MISSED: {c.describe()}", flush=True)
    print(json.dumps({**result, "failed": [c.name for c in missed]}), flush=True)
    return 1 if missed else 0
