"""Every seam in compat/ is registered with the private name it relies on and the versions it was checked against."""
from __future__ import annotations

import importlib
import inspect

import pytest
from packaging.version import Version

from compat.checked import REGISTRY, installed

SEAMS = ("torch", "diffusers", "ray", "starlette")


def public_names(module) -> set[str]:
    """What a seam module offers: its public functions and classes (not what it imports for itself)."""
    return {f"{module.__name__}.{name}" for name, value in vars(module).items()
            if not name.startswith("_") and (inspect.isfunction(value) or inspect.isclass(value))
            and (value.__module__ == module.__name__ or f"{module.__name__}.{name}" in REGISTRY)}


@pytest.mark.parametrize("library", SEAMS)
def test_every_seam_is_registered_with_its_library_and_checked_range(library):
    module = importlib.import_module(f"compat.{library}")
    offered = public_names(module) - {f"{module.__name__}.{n}" for n in ("PrivateUse", "Scope")}
    registered = {name for name in REGISTRY if name.startswith(f"{module.__name__}.")}
    assert offered == registered, f"unregistered: {offered - registered}; registered but gone: {registered - offered}"
    for name in registered:
        use = REGISTRY[name]
        low, high = map(Version, use.checked)
        assert use.library == library and low <= high and use.private and use.why, (name, use)
    if Version(installed(library)).release < Version(module.CHECKED[0]).release:
        pytest.fail(f"{library} {installed(library)} is older than compat/{library}.py was checked against "
                    f"({module.CHECKED[0]}): run tests/compat on it and lower the range")


def test_a_moved_private_name_says_where_it_was_last_checked():
    use = REGISTRY["compat.starlette.route_path"]
    message = use.mismatch("is gone")
    assert "starlette._utils.get_route_path is gone" in message and use.checked[0] in message
    assert "compat/starlette.py" in message
