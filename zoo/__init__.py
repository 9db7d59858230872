"""Models for tests, benches and the demo, made locally: tiny real pipelines and real-size meta models.

``zoo.tiny``: seeded diffusers folders built on first use (``python -m zoo.build``).
``zoo.real``: published real-size configs instantiated on torch's meta device.
Nothing in this package downloads.
"""
