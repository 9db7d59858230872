#!/usr/bin/env bash
# One prepared GPU check (< 8 minutes on one CUDA GPU): step time and peak device memory for speed
# mode, our layerwise streaming (pinned, side stream) and diffusers' group offloading
# (use_stream=True), on the medium Wan denoiser and real-size Wan2.1-1.3B blocks with random
# weights, plus pinned and pageable host->device bandwidth. Runs on CPU too (CUDA-only parts
# skipped), which is how CI keeps it working. Last line of output: one JSON object.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
# 450 s: the 8-minute budget minus the interpreter and import start-up.
exec timeout "${GPU_CHECK_TIMEOUT_S:-450}" "$PY" bench/gpu_check.py "$@"
