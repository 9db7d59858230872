#!/usr/bin/env bash
# One prepared GPU check (< 7.5 minutes on one CUDA GPU): step time and peak device memory for speed
# mode, our layerwise streaming per hosting tier (pinned; pageable and mapped through pinned
# staging; pageable unstaged as the negative control) and diffusers' group offloading
# (use_stream=True), on the medium Wan denoiser and real-size Wan2.1-1.3B blocks with random
# weights, each over max(speed step, streamed bytes / its tier's measured rate: pinned, staged or
# pageable); then the engine's CUDA-only tests (pytest tests/offload_core -k cuda: stream safety,
# a real pin refusal through the driver API, staged copies, blocking events, the link probe), the
# activation model's CUDA calibration (bench/gpu_activations.py) and bench/hook_cost.py --device
# cuda. Runs on CPU too (CUDA-only parts skipped), which is how CI keeps it working. Last line of
# output: one JSON object.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
# 450 s: a 7.5-minute run inside a 10-minute device call: the run itself, then the CUDA tests
# (120 s), the activation calibration (45 s), bench/hook_cost.py --device cuda (60 s: a tiny-width
# 14B structure) and FP8 widening's cost on one Wan2.1-14B block (60 s).
exec timeout "${GPU_CHECK_TIMEOUT_S:-450}" "$PY" bench/gpu_check.py "$@"
