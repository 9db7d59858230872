"""Components a stage replica's warm-up did not run, timed on the first call that runs them.

A pipeline's request decides whether some components run at all: HunyuanVideo 1.5's glyph encoder
only for quoted text, an image encoder only for image-to-video, Wan2.2's low-noise expert only after
its boundary step. The warm-up plans such a component from its meta facts
(:func:`deployments.replica.warmup.with_unrun_estimated`); this module owns what happens next: while
any of its layers is still estimated, each call runs with timing hooks on those components only
(none once all are measured), and the first call that runs them replaces the estimate with what it
measured. The worker then plans the stage again through the same entry as the warm-up's replan.

Run by the stage replica's worker, inside its call lock.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
from typing import Iterator, Mapping

import torch
from torch import nn

from offload_core.planner.measured_compute import MeasuredCompute, WarmupFigures
from offload_core.residency.compute_meter import LayerTiming

logger = logging.getLogger(__name__)


def merged(estimate: MeasuredCompute, figures: WarmupFigures) -> MeasuredCompute:
    """``estimate`` with the layers ``figures`` ran replaced by their measured seconds per pass; layers
    still unrun stay estimated. A component that never ran before takes its measured non-layer compute."""
    measured = dict(zip(figures.order, figures.layer_s))
    layer_s = tuple((key, measured.get(key, seconds)) for key, seconds in estimate.layer_s)
    first_run = len(estimate.estimated) == len(estimate.layer_s)
    return dataclasses.replace(estimate, layer_s=layer_s,
                               estimated=tuple(key for key in estimate.estimated if key not in measured),
                               rest_s=figures.rest_s if first_run else estimate.rest_s,
                               layer_wait_s=tuple(zip(figures.order, figures.layer_wait_s)) if first_run
                               else estimate.layer_wait_s,
                               last_pass=figures.last_pass if first_run else estimate.last_pass)


class FirstUse:
    """The stage's compute per component, and the components whose layers are still estimated."""

    def __init__(self, replica: str, modules: Mapping[str, nn.Module], device: torch.device):
        self.replica, self._modules, self._device = replica, modules, device
        self.compute: dict[str, MeasuredCompute] = {}  # none until the warm-up's figures are tracked
        self._changed = False

    def track(self, compute: Mapping[str, MeasuredCompute]) -> None:
        """Start from the warm-up's figures: what is still estimated there is timed on first use."""
        self.compute, self._changed = dict(compute), False

    @property
    def pending(self) -> tuple[str, ...]:
        """Components with layers no call has run yet."""
        return tuple(name for name, m in self.compute.items() if m.estimated and name in self._modules)

    @contextlib.contextmanager
    def timed(self) -> Iterator[None]:
        """Around one call's work: times the pending components (nothing is hooked when none is)."""
        pending = self.pending
        if not pending:
            yield
            return
        with LayerTiming({name: self._modules[name] for name in pending}, device=self._device) as timing:
            yield
        for name, figures in timing.figures().items():
            if not figures.order:
                continue  # not run by this call either
            before = self.compute[name]
            self.compute[name] = merged(before, figures)
            self._changed = True
            logger.info("%s: %s measured on first use: %d layer(s) ran, %.3f ms per use (estimated %.3f ms)%s",
                        self.replica, name, len(figures.order), self.compute[name].per_use_s * 1e3,
                        before.per_use_s * 1e3, f"; still estimated: {len(self.compute[name].estimated)} layer(s)"
                        if self.compute[name].estimated else "")

    def take_changed(self) -> dict[str, MeasuredCompute] | None:
        """The compute to plan again with, once after a call measured something new; else None."""
        if not self._changed:
            return None
        self._changed = False
        return dict(self.compute)


__all__ = ["FirstUse", "merged"]
