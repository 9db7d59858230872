"""Activation memory per request shape: a linear model over a family's shape features, calibrated.

The peak bytes a stage call allocates beyond its weights grow with what the request asks for:
tokens per image, frames, batch. A model family names its features per stage (for Wan's
denoiser: the batch and batch x latent tokens), and :func:`calibrate` fits one coefficient per
feature to measured peaks (``offload_core.residency.activation_meter.measure_activations``): as many
calibration shapes as features determine it exactly, more are fitted by least squares. The
prediction scales with the element size: a model calibrated in float32 predicts half for bfloat16
(ops that compute in float32 make that an underestimate; calibrate in the dtype served).

Pure arithmetic: the planner imports it, and no runtime module.

Run by each stage replica (its warm-up fits the model, its calls predict) and by whichever process plans.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


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

    def predict(self, features: Sequence[float], dtype_bytes: int | None = None) -> int:
        if len(features) != len(self.coefficients):
            raise ValueError(f"{len(features)} features for a model of {self.feature_names}")
        scale = 1.0 if dtype_bytes is None else dtype_bytes / self.dtype_bytes
        return max(0, round(scale * sum(c * f for c, f in zip(self.coefficients, features))))

    def explain(self) -> str:
        return " + ".join(f"{c:.4g} B x {n}" for c, n in zip(self.coefficients, self.feature_names))


def calibrate(feature_names: Sequence[str], samples: Sequence[ActivationSample], dtype_bytes: int) -> ActivationModel:
    """Least-squares coefficients (exact for as many independent samples as features)."""
    k = len(feature_names)
    if len(samples) < k:
        raise CalibrationError(f"{len(samples)} calibration shapes for {k} features {tuple(feature_names)}")
    # Normal equations A^T A c = A^T y, solved by Gaussian elimination with partial pivoting.
    ata = [[sum(s.features[i] * s.features[j] for s in samples) for j in range(k)] for i in range(k)]
    aty = [sum(s.features[i] * s.peak_bytes for s in samples) for i in range(k)]
    coefficients = _solve(ata, aty, feature_names)
    return ActivationModel(tuple(feature_names), tuple(coefficients), dtype_bytes)


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
