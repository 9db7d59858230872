"""Test and bench support that ships nowhere near the service: the simulated accelerator.

``testing.sim`` (:class:`~testing.sim.SimDevice`) and ``testing.sim_link`` (its rates) are imported
by ``tests/`` and ``bench/`` only; an import contract in ``pyproject.toml`` keeps ``offload_core``,
``cluster`` and ``deployments`` from importing them, and the wheel does not package them.
"""
