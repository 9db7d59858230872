#!/usr/bin/env bash
# One prepared GPU check (<= 8 minutes on one CUDA GPU, by the timeout below): step time and peak
# device memory for speed mode, our layerwise streaming per hosting tier (pinned; pageable and mapped
# through pinned staging, fills split over the copier's threads; pageable unstaged as the negative
# control; FP8 pinned against its fake-quantized reference) and diffusers' group offloading
# (use_stream=True), on the medium Wan denoiser and real-size Wan2.1-1.3B with random weights at 6
# latent frames (mapped: the weights saved to a safetensors folder and loaded from it) and at 1
# latent frame (the image regime: speed, pinned, FP8; median of >= 5 steps); then the engine's
# CUDA-only tests (pytest tests/offload_core -k cuda), the activation model's CUDA calibration
# (bench/gpu_activations.py), bench/hook_cost.py --device cuda and FP8 widening on a Wan2.1-14B block.
# Runs on CPU too (CUDA-only parts skipped), which is how CI keeps it working. Last line of output:
# one JSON object, its `summary` the figures the run is judged by (bench/gpu_summary.py).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
# 470 s (under 8 minutes): the three cases (~2.5 minutes: real-size builds, pins, FP8 quantized on the
# host for the eager and the fused widen, the mapped copy written once), then the CUDA tests (150 s),
# the activation calibration (45 s), bench/hook_cost.py --device cuda (45 s) and FP8 widening on one
# Wan2.1-14B block (60 s: the fused widen compiles in its warm-up); a tiling decoder's comparison last, in
# what is left (--tiled-timeout, 40 s at most; not started when under MIN_PART_S is left, and not judged).
# --budget-s: the sub-benches get what the cases left of it, so the JSON comes out before the timeout.
BUDGET_S="${GPU_CHECK_TIMEOUT_S:-470}"
exec timeout "$BUDGET_S" "$PY" bench/gpu_check.py --hook-cost-timeout 45 --widen-timeout 60 \
    --budget-s "$((BUDGET_S - 10))" "$@"
