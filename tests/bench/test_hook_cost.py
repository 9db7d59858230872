"""bench/hook_cost.py subtracts every host copy the hooks issue from the hook time it reports."""
from __future__ import annotations

import pytest
import torch

from bench import hook_cost
from tests.offload_core.residency.test_lifecycle import STAGES, Toy


def toy_case():
    components = {"a": Toy(0), "b": Toy(1)}
    x = torch.randn(2, 16)
    return components, STAGES, lambda: components["b"](components["a"](x))


def test_every_copied_byte_is_timed_as_a_copy_not_as_hook_time():
    cost = hook_cost.measure_case("toy", *toy_case(), requests=2)
    assert cost.layer_forwards == 8 and cost.copy_us_per_layer > 0


def test_a_copy_path_the_timer_does_not_wrap_fails_the_bench(monkeypatch):
    # As the ring copied from 1811ccd on, while the bench wrapped copy_to only: the copies went
    # through copy_host_bytes on the class, unseen, and counted as hook time.
    monkeypatch.setattr(hook_cost._HookClock, "_timed_copy", lambda self, copy: copy)  # installs no timer
    with pytest.raises(RuntimeError, match="copy timer saw 0 B of the"):
        hook_cost.measure_case("toy", *toy_case(), requests=1)


def test_the_profile_lists_the_hooks_own_work_and_none_of_the_layers_compute():
    # cProfile runs inside the hook windows only: the layers' own forwards (nn.Linear's) run
    # between a pre-hook and its post-hook, outside, and must not be charged to the hooks.
    cost = hook_cost.measure_case("toy", *toy_case(), requests=1)
    functions = {line.function for line in cost.profile}
    assert any(name.startswith(("ring.py:", "engine.py:", "unit.py:")) for name in functions), functions
    # The engine's own hooks are named pre_forward/post_forward (unit.py): only a module's forward itself
    # and the kernels it calls are compute (matching any "forward" failed whenever those hooks ranked top 12).
    compute = [name for name in functions if name.endswith(":forward") or "_nn.linear" in name or "addmm" in name]
    assert not compute, functions
    assert all(line.calls_per_layer > 0 and line.own_us_per_layer >= 0 for line in cost.profile)
