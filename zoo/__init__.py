"""Models for tests, benches and the demo, made locally: tiny real pipelines.

``zoo.tiny``: seeded diffusers folders built on first use (``python -m zoo.build``).
Real-size models on torch's meta device live in ``offload_core.planner.real_models`` (the planner needs them).
Nothing in this package downloads.
"""
