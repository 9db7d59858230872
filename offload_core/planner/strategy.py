"""How one pipeline component keeps its weights across the stages of a request.

Runs in whichever process plans: ``offload-serve plan`` and each stage replica (through ``cluster/replica/plan.py``).
"""
from __future__ import annotations

import enum


class Strategy(enum.Enum):
    # Everything on the device all the time: no copies, the most device memory (speed mode).
    RESIDENT = "resident"
    # The whole component comes in for its stage and leaves after it: one copy of all its weights
    # per request; no hooks, so it suits components without layer groups (Flux's AutoencoderKL).
    MODEL_OFFLOAD = "model_offload"
    # The streaming engine: non-layer weights on the device, layers streamed through a prefetch
    # ring (some kept resident); the device holds non-layer + resident + slots at peak.
    LAYERWISE = "layerwise"

    __hash__ = object.__hash__  # identity, as HostingTier's: the plan search's memo keys hash it
