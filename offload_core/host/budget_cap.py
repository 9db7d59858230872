"""A replica's own host-memory budget: what a user sets per stage, and the lease cap it enforces.

A user says ``host_memory_budget: 16GiB`` (bytes) or ``0.25`` (a fraction of the node's spendable
RAM) per stage. The replica then plans within min(its budget, what the node ledger can grant):
:class:`CappedBudget` wraps the node's budget and refuses, with the numbers, any lease that would
take this replica past its cap. Bytes the replica holds whatever it plans (layers a converting
``dtype`` already copied into anonymous memory: a MAPPED plan keeps them as they are) count
against the budget first; a budget below them fits no plan and is an error at start
(:class:`BudgetTooSmall`, naming the smallest budget that works).
"""
from __future__ import annotations

import functools
import re
import threading
from dataclasses import dataclass

from offload_core.host.budget import Lease, MemoryBudget, Refusal

KiB, MiB, GiB, TiB = 1024, 1024**2, 1024**3, 1024**4
# pydantic.ByteSize reads one-letter units as decimal (1k = 1000 B); here they stay binary, as
# before (16g = 16 GiB), so they are spelled out before it parses.
_ONE_LETTER = re.compile(r"(?<=[\d\s])([kmgtKMGT])\s*$")
# The whole text is one number and one unit (ByteSize alone would read "16GiB of RAM" as 16 GiB).
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


@functools.cache
def _byte_size():
    """pydantic's ByteSize parser, imported on the first parse, not with the engine: offload_core runs
    on torch alone (a GPU image without pydantic could not import the engine, nor run its CUDA tests)."""
    from pydantic import ByteSize, TypeAdapter

    return TypeAdapter(ByteSize)


class BudgetTooSmall(ValueError):
    """A host-memory budget below what every plan needs; ``smallest`` is the least that works."""

    def __init__(self, owner: str, budget: int, smallest: int, why: str):
        self.owner, self.budget, self.smallest = owner, budget, smallest
        super().__init__(f"{owner}: host_memory_budget {format_bytes(budget)} ({budget} B) is too small for any "
                         f"plan; the smallest that works is {format_bytes(smallest)} ({smallest} B): {why}")


@dataclass(frozen=True)
class HostBudgetSpec:
    """A per-replica host budget as configured: exactly one of bytes or a fraction of spendable RAM."""

    nbytes: int | None = None
    fraction: float | None = None

    def __post_init__(self) -> None:
        if (self.nbytes is None) == (self.fraction is None):
            raise ValueError("a host budget is either bytes or a fraction of the node's spendable RAM, not both")
        if self.nbytes is not None and self.nbytes < 0:
            raise ValueError(f"host_memory_budget must be >= 0 bytes, got {self.nbytes}")
        if self.fraction is not None and not 0.0 < self.fraction <= 1.0:
            raise ValueError(f"a fractional host_memory_budget must be in (0, 1], got {self.fraction}")

    def resolve(self, spendable: int) -> int:
        """The budget in bytes on a node with ``spendable`` bytes of host RAM."""
        return int(self.nbytes) if self.nbytes is not None else int(spendable * self.fraction)

    def describe(self) -> str:
        return format_bytes(self.nbytes) if self.nbytes is not None else f"{self.fraction:g} of spendable RAM"


def parse_host_budget(value: str | int | float) -> HostBudgetSpec:
    """``"16GiB"``, ``"512MB"``, ``2**30`` (bytes) or ``0.25`` (a fraction in (0, 1]) -> a spec.

    A float is a fraction and an int is bytes; a bare ``1`` would be ambiguous, so bytes below 1 KiB
    are refused as a likely typo for a fraction.
    """
    if isinstance(value, bool):
        raise TypeError(f"host_memory_budget must be a size or a fraction, got {value!r}")
    if isinstance(value, float):
        return HostBudgetSpec(fraction=value)
    if isinstance(value, int):
        if 0 < value < KiB:
            raise ValueError(f"host_memory_budget {value} B is under 1 KiB: write a size such as '16GiB', "
                             "or a fraction such as 0.25")
        return HostBudgetSpec(nbytes=value)
    if not isinstance(value, str):
        raise TypeError(f"host_memory_budget must be a size string, bytes or a fraction, got {value!r}")
    match = _SIZE.match(value)
    if match is not None and not match.group(2):  # "0.5" is a fraction, "1073741824" bytes
        return parse_host_budget(float(match.group(1)) if "." in match.group(1) else int(match.group(1)))
    try:
        if match is None:
            raise ValueError("not one number and one unit")
        nbytes = int(_byte_size().validate_python(_ONE_LETTER.sub(r"\1iB", value)))
    except ValueError as exc:  # pydantic's ValidationError is a ValueError
        why = exc.errors()[0]["msg"] if hasattr(exc, "errors") else str(exc)  # pydantic's ValidationError
        raise ValueError(f"host_memory_budget {value!r} is not a size ({why}): write e.g. '16GiB', '512MiB', "
                         "'20GB' or a fraction of the node's spendable RAM such as 0.25") from None
    return parse_host_budget(nbytes)


def format_bytes(nbytes: int) -> str:
    for unit, size in (("TiB", TiB), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if abs(nbytes) >= size:
            return f"{nbytes / size:.2f} {unit}"
    return f"{nbytes} B"


class CappedBudget(MemoryBudget):
    """A node budget seen through one replica's cap: never grants it more than ``cap`` in all."""

    def __init__(self, inner: MemoryBudget, cap: int, label: str = "replica budget"):
        if cap < 0:
            raise ValueError(f"cap must be >= 0, got {cap}")
        self.inner, self.cap, self._label = inner, int(cap), label
        self._mine: dict[str, Lease] = {}
        self._lock = threading.Lock()

    def leased(self) -> int:
        """Bytes this replica holds through the cap (not the whole node's)."""
        with self._lock:
            return sum(lease.nbytes for lease in self._mine.values())

    def room(self) -> int:
        return max(0, self.cap - self.leased())

    def request(self, nbytes: int, owner: str, priority: float = 0.0, purpose: str = "") -> Lease | Refusal:
        room = self.room()
        if nbytes > room:
            return Refusal(owner, nbytes, min(room, self.inner.available()),
                           f"{self._label}: {nbytes} B asked, {room} B of its {self.cap} B cap left")
        got = self.inner.request(nbytes, owner, priority, purpose)
        if isinstance(got, Lease):
            with self._lock:
                self._mine[got.lease_id] = got
        else:  # the node's answer, bounded by what the cap would still allow
            got = Refusal(got.owner, got.nbytes, min(got.available, room), got.reason)
        return got

    def release(self, lease: Lease) -> None:
        self.inner.release(lease)
        with self._lock:
            self._mine.pop(lease.lease_id, None)

    def outstanding(self, owner: str | None = None) -> tuple[Lease, ...]:
        with self._lock:
            return tuple(l for l in self._mine.values() if owner is None or l.owner == owner)

    def capacity(self) -> int:
        return min(self.cap, self.inner.capacity())

    def available(self) -> int:
        return min(self.room(), self.inner.available())


@dataclass(frozen=True)
class HostMemoryStatus:
    """A replica's host memory as the report shows it."""

    budget_bytes: int | None  # the configured budget resolved on this node; None: no budget set
    leased_bytes: int  # this replica's own leases (pins, pageable copies)
    used_bytes: int  # anonymous host bytes its weights hold now (own layer copies, parked, converted)
    shared: tuple[dict, ...] = ()  # one entry per shared store it maps (see offload_core.shared_store.store)

    def to_json(self) -> dict:
        return {"budget_bytes": self.budget_bytes, "leased_bytes": self.leased_bytes,
                "used_bytes": self.used_bytes, "shared": [dict(s) for s in self.shared]}
