"""What each seam in :mod:`compat` wraps, and the library versions it was checked against.

Every seam function is registered here with the private name it relies on; ``tests/compat/`` reads
the registry (no function without a record) and prints the checked range next to the installed
version when a private name has moved. Pure Python; runs in whichever process imports a seam.
"""
from __future__ import annotations

import importlib.metadata
from dataclasses import dataclass
from typing import Callable, TypeVar

F = TypeVar("F", bound=Callable)


@dataclass(frozen=True)
class PrivateUse:
    """One private name of ``library`` that a seam relies on.

    ``checked``: the lowest and highest versions of ``library`` that ``tests/compat/`` passed on
    (widen it after they pass on another); ``why``: why no public API serves instead.
    """

    library: str
    private: str
    checked: tuple[str, str]
    why: str

    def mismatch(self, detail: str) -> str:
        """The message a compat test fails with: what moved, where it was last seen working."""
        low, high = self.checked
        return (f"{self.library} {installed(self.library)}: {self.private} {detail} "
                f"(checked against {self.library} {low}..{high}; fix the seam in compat/{self.library}.py)")


# seam function's qualified name (module.function) -> what it relies on
REGISTRY: dict[str, PrivateUse] = {}


def installed(library: str) -> str:
    """The installed distribution's version (``library`` as pip names it)."""
    return importlib.metadata.version(library)


def relies_on(library: str, private: str, checked: tuple[str, str], why: str) -> Callable[[F], F]:
    """Register the decorated seam as the one use of ``private``; the function itself is unchanged."""
    if not private or not why:
        raise ValueError(f"a seam of {library} must name the private API it uses and why no public one serves")

    def register(fn: F) -> F:
        record(f"{fn.__module__}.{fn.__name__}", PrivateUse(library, private, checked, why))
        return fn

    return register


def record(name: str, use: PrivateUse) -> None:
    """Register ``name`` (``compat.<library>.<seam>``; a re-exported class has no function to decorate)."""
    if name in REGISTRY:
        raise ValueError(f"{name} is registered twice: one seam per private use")
    REGISTRY[name] = use
