"""Streaming: the engine that brings each layer's weights to the device just in time.

Owns the device (copy stream, events), the layer layout (flat per-dtype buffers, placeholders;
pure math the planner shares), one layer's host copy, the prefetch ring of device slots, the
streamer's hooks and the meter of weight bytes on the device; the pinned staging ring and its host
copier thread for PAGEABLE and MAPPED layers (``staging``, ``copier``); the engine's configuration
(``config``); and the simulated accelerator CI checks overlap on (``sim``).
"""
