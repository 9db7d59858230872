"""The public API (``offload_core/__init__.py``) is lazy: each name resolves to its module's object on first use."""
from __future__ import annotations

import importlib

import offload_core


def test_every_public_name_resolves_to_the_object_its_module_defines():
    assert sorted(offload_core._HOME) == sorted(offload_core.__all__)
    for name in offload_core.__all__:
        assert getattr(offload_core, name) is getattr(importlib.import_module(offload_core._HOME[name]), name)
    assert set(offload_core.__all__) <= set(dir(offload_core))
