"""LoRA adapters per request in a step batch: which adapter each row of a forward uses.

The configured adapters are :class:`ServedLora` (name, file or folder, default scale; from the
config only, never from a request). A request names one in its spec (``GenerationSpec.lora``);
:func:`row_adapters` maps a batch's forward rows to their requests' adapters, and
:class:`LoraStepper` wraps a family's stepper so each forward runs inside ``LoraSet.rows``
(``offload_core.lora``): the base layer streams and multiplies once for the whole batch, and each
row adds its own adapter's low-rank term (a row without one is the base output, bitwise).

Torch only; run by the Denoiser replica (the stepper) and read by the ingress (the names).
"""
from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import Protocol, Sequence

import torch

from deployments.models.steppers import Stepper, StepRequest, request_rows

logger = logging.getLogger(__name__)

# A request's lora_scale is refused outside this range: a scale of 4 already moves the tiny zoo's
# output as far as the base model's own variation across seeds; 0 is allowed (the base model's
# output up to rounding) and negative scales subtract a style, as diffusers' set_adapters allows.
MAX_LORA_SCALE = 4.0

RowChoice = tuple[str, float] | None


@dataclass(frozen=True)
class ServedLora:
    """One configured adapter: what the Denoiser loads at start and the ingress lets requests name."""

    name: str
    path: str  # a local .safetensors file or a folder holding one (the config's; never a request's)
    scale: float = 1.0  # a request that names the adapter without lora_scale gets this


class RowsContext(Protocol):
    """``offload_core.lora.LoraSet``'s per-forward routing, as the stepper needs it."""

    def rows(self, per_row: Sequence[RowChoice]) -> contextlib.AbstractContextManager: ...


def request_choice(request: StepRequest) -> RowChoice:
    """The (adapter, scale) a request's rows use; None: the base model."""
    spec = request.spec
    return None if spec.lora is None else (spec.lora, float(spec.lora_scale))


def row_adapters(batch: list[StepRequest]) -> list[RowChoice]:
    """Each forward row's adapter, in the forward's row order: a request's n rows (its conditional
    branch) in batch order, then, when guided, its n unconditional rows at the same offsets in the
    second half (``deployments.models.steppers.request_rows``: the same rows in either branch order).
    Both of a request's branches use its adapter, as diffusers' pipeline runs both through the
    adapted transformer."""
    guided = batch[0].uncond is not None
    total = sum(r.rows for r in batch)
    per_row: list[RowChoice] = [None] * total
    for request, rows in zip(batch, request_rows(batch, guided)):
        choice = request_choice(request)
        for row in rows:
            per_row[row] = choice
    return per_row


class LoraStepper:
    """A family's stepper whose forwards apply each request's adapter to its own rows.

    A batch where no request names an adapter runs the family's forward as is (no routing at all);
    otherwise the forward runs inside ``loras.rows(per_row)``."""

    def __init__(self, inner: Stepper, loras: RowsContext):
        self.inner, self.loras = inner, loras

    def __getattr__(self, name):  # the family's own helpers (wan_i2v's model_input, ...)
        return getattr(self.inner, name)

    def start(self, encoded, spec, on_step=None) -> StepRequest:
        return self.inner.start(encoded, spec, on_step=on_step)

    def forward(self, batch: list[StepRequest]) -> list[torch.Tensor]:
        per_row = row_adapters(batch)
        if all(choice is None for choice in per_row):
            return self.inner.forward(batch)
        with self.loras.rows(per_row):
            return self.inner.forward(batch)


__all__ = ["MAX_LORA_SCALE", "LoraStepper", "RowChoice", "ServedLora", "request_choice", "row_adapters"]
