"""Activation memory per request shape: a linear model over a family's shape features, calibrated.

The peak bytes a stage call allocates beyond its weights grow with what the request asks for:
tokens per image, frames, batch. A model family names its features per stage (for Wan's
denoiser: the batch and batch x latent tokens), and :func:`calibrate` fits one coefficient per
feature to measured peaks (``offload_core.residency.activation_meter.measure_activations``): as many
calibration shapes as features determine it exactly, more are fitted by least squares. No
coefficient is negative: a call never frees bytes per token it processes, so a negative fit is a
measurement artifact, and extrapolated to a real-size shape (10^4 tokens against the calibration's
~10) it predicts less than nothing, which lets admission overcommit a GPU. Such a feature is
dropped and the others refitted (the least residual among the fits whose coefficients are all
non-negative; the model names what it dropped). The
prediction scales with the element size: a model calibrated in float32 predicts half for bfloat16
(ops that compute in float32 make that an underestimate; calibrate in the dtype served).

Pure arithmetic: the planner imports it, and no runtime module.

Run by each stage replica (its warm-up fits the model, its calls predict) and by whichever process plans.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Sequence

# A call leases its predicted activations plus this margin (a replica plans this much free of weights, and the
# planner keeps it over a measured forward): predictions are within 10 % of the measured peak on held-out
# shapes, and a decode call in bench/shared_gpu.py held 12 % more than its prediction (a 48x32 image).
ACTIVATION_MARGIN = 1.15


class CalibrationError(ValueError):
    """The calibration shapes do not determine the model (too few, or features not independent)."""


@dataclass(frozen=True)
class ActivationSample:
    """One measured call: its features and the activation peak it reached."""

    features: tuple[float, ...]
    peak_bytes: int


@dataclass(frozen=True)
class ActivationModel:
    """peak bytes = sum(coefficient x feature), scaled by element size over the calibration's."""

    feature_names: tuple[str, ...]
    coefficients: tuple[float, ...]
    dtype_bytes: int  # element size the calibration ran at
    dropped: tuple[str, ...] = ()  # features whose fitted coefficient was negative, refitted without them (0)

    def predict(self, features: Sequence[float], dtype_bytes: int | None = None) -> int:
        if len(features) != len(self.coefficients):
            raise ValueError(f"{len(features)} features for a model of {self.feature_names}")
        scale = 1.0 if dtype_bytes is None else dtype_bytes / self.dtype_bytes
        return max(0, round(scale * sum(c * f for c, f in zip(self.coefficients, features))))

    def explain(self) -> str:
        terms = " + ".join(f"{c:.4g} B x {n}" for c, n in zip(self.coefficients, self.feature_names))
        return terms + (f" (dropped, fitted negative: {', '.join(self.dropped)})" if self.dropped else "")


def calibrate(feature_names: Sequence[str], samples: Sequence[ActivationSample], dtype_bytes: int) -> ActivationModel:
    """Least-squares coefficients (exact for as many independent samples as features), none negative."""
    k = len(feature_names)
    if len(samples) < k:
        raise CalibrationError(f"{len(samples)} calibration shapes for {k} features {tuple(feature_names)}")
    coefficients = _least_squares(range(k), samples, feature_names)
    if min(coefficients) >= 0:
        return ActivationModel(tuple(feature_names), tuple(coefficients), dtype_bytes)
    return _non_negative(feature_names, samples, dtype_bytes)


def _least_squares(kept: Sequence[int], samples: Sequence[ActivationSample], names: Sequence[str]) -> list[float]:
    """Coefficients of the features ``kept`` (indices), the others 0."""
    # Normal equations A^T A c = A^T y, solved by Gaussian elimination with partial pivoting.
    ata = [[sum(s.features[i] * s.features[j] for s in samples) for j in kept] for i in kept]
    aty = [sum(s.features[i] * s.peak_bytes for s in samples) for i in kept]
    solved = dict(zip(kept, _solve(ata, aty, [names[i] for i in kept])))
    return [solved.get(i, 0.0) for i in range(len(names))]


def _non_negative(names: Sequence[str], samples: Sequence[ActivationSample], dtype_bytes: int) -> ActivationModel:
    """The best fit over subsets of the features whose coefficients are all >= 0 (2^k fits: k <= 3 here)."""
    best: tuple[float, list[float], tuple[int, ...]] | None = None
    k = len(names)
    for size in range(k - 1, 0, -1):
        for kept in itertools.combinations(range(k), size):
            try:
                coefficients = _least_squares(kept, samples, names)
            except CalibrationError:
                continue
            if min(coefficients) < 0:
                continue
            residual = sum((s.peak_bytes - sum(c * f for c, f in zip(coefficients, s.features))) ** 2 for s in samples)
            if best is None or residual < best[0]:
                best = (residual, coefficients, kept)
    if best is None:  # a single feature's fit is sum(f y) / sum(f^2) >= 0 for features and peaks >= 0
        raise CalibrationError(f"no non-negative fit of {tuple(names)} to the peaks {[s.peak_bytes for s in samples]}")
    _, coefficients, kept = best
    dropped = tuple(name for i, name in enumerate(names) if i not in kept)
    return ActivationModel(tuple(names), tuple(coefficients), dtype_bytes, dropped)


def _solve(a: list[list[float]], b: list[float], names: Sequence[str]) -> list[float]:
    n = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    scale = max((abs(x) for row in a for x in row), default=0.0) or 1.0
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        # Relative to the matrix's size: features that move together leave a near-zero pivot.
        if abs(m[pivot][col]) <= 1e-12 * scale:
            raise CalibrationError(f"the calibration shapes do not separate the features {tuple(names)}: "
                                   f"vary {names[col]!r} independently of the others")
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(n):
            if r != col:
                factor = m[r][col] / m[col][col]
                m[r] = [x - factor * y for x, y in zip(m[r], m[col])]
    return [m[i][n] / m[i][i] for i in range(n)]
