"""The figures one GPU check run is judged by, gathered from its parts into one ``summary`` object.

Imported by ``bench/gpu_check.py`` (its directory is on the path when it runs). Every key is
present in every run; a figure the run could not measure (CPU mode, a skipped part) is None.

- ``pageable_over_pinned``, ``mapped_over_pinned``: real-size Wan2.1-1.3B at gpu_check's shape, the
  staged tiers' step over the pinned step (targets 1.25 and 1.3);
- ``fp8_over_bf16_1frame``, ``fp8_over_bf16_compute_bound``: FP8 pinned over bf16 pinned at 1 latent
  frame and at gpu_check's shape (targets 0.65 and 1.05); ``fp8_fused_over_bf16_1frame`` and
  ``fp8_fused_over_bf16_compute_bound`` the same with the fused, compiled widen (``WidenMode.FUSED``);
- ``pinned_over_bound_1frame``: the pinned step at 1 frame (median of its steps) over
  max(resident step, bytes / pinned rate) (target 1.15);
- ``hook_us_per_layer``: bench/hook_cost.py's worst case (target 60), beside ``hook_us_per_layer_denoise``,
  its case of four forwards per use (a Denoiser's steps: parameters pointed once per use);
- ``activation_error_min``, ``activation_error_max``: bench/gpu_activations.py's held-out errors
  (target -5 % ... +30 %), beside ``activation_error_requested_min`` and ``..._max``, the same calls fitted
  on the bytes their tensors requested (no allocator rounding): a miss on the first pair only is the
  caching allocator's, not the activation model's;
- ``cuda_tests_failed``: the CUDA-only tests that failed (target 0);
- ``staged_GBps_omp1``: the link probe's staged rate in this run (gpu_check runs under
  ``OMP_NUM_THREADS=1``, as Ray runs a replica), beside ``memcpy_GBps``, the fill probe's best host
  memcpy into pinned memory, and ``pinned_GBps`` (target: staged >= 0.7 x min(pinned, memcpy)).
"""
from __future__ import annotations

import re


def _step(result: dict | None, way: str, key: str = "step_s") -> float | None:
    row = (result or {}).get("rows", {}).get(way, {})
    return row.get(key)


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or not b else round(a / b, 3)


def cuda_tests_failed(tests: dict) -> int | None:
    """Failed (and errored) tests in pytest's last line; None when the tests did not run, or ran and
    counted nothing ("no tests ran" after an internal error, a timeout): never 0 for a run that passed none."""
    summary = tests.get("summary")
    if not isinstance(summary, str) or "skipped" in tests:
        return None
    counts = dict((word, int(n)) for n, word in re.findall(r"(\d+) (failed|error|errors|passed)", summary))
    if not counts:
        return None
    return counts.get("failed", 0) + counts.get("error", 0) + counts.get("errors", 0)


COMPUTE_BOUND_CASE = "wan2.1-1.3b-random"  # real size at 6 latent frames
IMAGE_CASE = "wan2.1-1.3b-random-1frame"  # the image regime


def summary_of(link: dict, results: list[dict], hooks: dict, calibration: dict, tests: dict) -> dict:
    """:func:`summary` of the cases that ran, each read by name: a rerun may run only some of them."""
    ran = {result["case"]: result for result in results}
    return summary(link, ran.get(COMPUTE_BOUND_CASE), ran.get(IMAGE_CASE), hooks, calibration, tests)


def summary(link: dict, compute_bound: dict | None, one_frame: dict | None, hooks: dict, calibration: dict,
            tests: dict) -> dict:
    pinned = _step(compute_bound, "layerwise")
    pinned_1f = _step(one_frame, "layerwise", "median_step_s")
    bound_1f = _step(one_frame, "layerwise", "bound_s")
    errors = [row["error"] for row in calibration.get("rows", ())]
    on_requested = [row["error_requested"] for row in calibration.get("rows", ())
                    if row.get("error_requested") is not None]
    return {
        "pageable_over_pinned": _ratio(_step(compute_bound, "layerwise_pageable"), pinned),
        "mapped_over_pinned": _ratio(_step(compute_bound, "layerwise_mapped"), pinned),
        "unstaged_over_pageable": _ratio(_step(compute_bound, "layerwise_pageable_unstaged"),
                                         _step(compute_bound, "layerwise_pageable")),
        "fp8_over_bf16_1frame": _ratio(_step(one_frame, "layerwise_fp8", "median_step_s"), pinned_1f),
        "fp8_over_bf16_compute_bound": _ratio(_step(compute_bound, "layerwise_fp8"), pinned),
        "fp8_fused_over_bf16_1frame": _ratio(_step(one_frame, "layerwise_fp8_fused", "median_step_s"), pinned_1f),
        "fp8_fused_over_bf16_compute_bound": _ratio(_step(compute_bound, "layerwise_fp8_fused"), pinned),
        "pinned_over_bound_1frame": _ratio(pinned_1f, bound_1f),
        "hook_us_per_layer": hooks.get("hook_us_per_layer_max"),
        "hook_us_per_layer_denoise": hooks.get("hook_us_per_layer", {}).get("wan2.1-14b-structure-denoise"),
        "activation_error_min": min(errors) if errors else None,
        "activation_error_max": max(errors) if errors else None,
        "activation_error_requested_min": min(on_requested) if on_requested else None,
        "activation_error_requested_max": max(on_requested) if on_requested else None,
        "cuda_tests_failed": cuda_tests_failed(tests),
        "staged_GBps_omp1": link.get("staged_GBps"),
        "memcpy_GBps": link.get("memcpy_GBps"),
        "pinned_GBps": link.get("pinned_GBps"),
        "copier_threads": link.get("copier_threads"),
    }
