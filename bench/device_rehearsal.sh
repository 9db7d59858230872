#!/usr/bin/env bash
# The prepared device run (bench/device_run.sh), rehearsed on a CPU machine in a venv that holds what the
# GPU machine's image holds (the device tool's KINDS.md, read 2026-11-17: Python 3.12, torch 2.11.0,
# transformers 5.17.0, huggingface_hub 1.33.0, pytest with pytest-xdist, and no pydantic, no Ray, no
# diffusers but the wheels from ../shared/gpu-wheels). It catches an import the device lacks before a
# device minute is spent on it: it found a test module importing pydantic (bd9d1ee), which would have
# stopped every CUDA test there at collection (moved out in 57302f6).
#
# Runs bench/device_run.sh, the device's command, with the same wheels, and checks what it leaves in $OUT.
# Needs the package registry (the venv, built once: ~3 minutes here); then ~2.5 minutes a run. Arguments go to
# bench/gpu_check.sh. Exits non-zero when the CUDA tests do not collect or the check fails.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${DEVICE_REHEARSAL_VENV:-${TMPDIR:-/tmp}/offload-serve-device-venv}"
WHEELS_FROM="${GPU_WHEELS:-../shared/gpu-wheels}"
if [ ! -x "$VENV/bin/python" ]; then
  PY312="${PYTHON312:-}"  # the image's Python: 3.12 (a pyenv shim may name one it will not run)
  for candidate in python3.12 "$(pyenv root 2>/dev/null || echo /nonexistent)"/versions/3.12*/bin/python3.12; do
    if [ -z "$PY312" ] && "$candidate" -c "" 2>/dev/null; then PY312="$candidate"; fi
  done
  "${PY312:?no Python 3.12 found: set PYTHON312}" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip
  "$VENV/bin/python" -m pip install -q torch==2.11.0  # first: nothing below may pull another torch
  "$VENV/bin/python" -m pip install -q transformers==5.17.0 huggingface_hub==1.33.0 accelerate==1.15.0 \
    tokenizers==0.23.2 safetensors==0.8.0 numpy==2.5.2 psutil nvidia-ml-py pyyaml pytest pytest-xdist \
    requests pillow httpx typer regex
  # No pydantic: the image has none (fcfd650's engine import of it cost the H200's first run its CUDA tests); typer
  # pulls it in here, and transformers imports without it.
  "$VENV/bin/python" -m pip uninstall -q -y pydantic pydantic_core
fi
export PATH="$VENV/bin:$PATH" OUT="${OUT:-$(mktemp -d)}"
# What gpu_check runs on CUDA, collected here (on CPU it would skip them): a collection error or an
# unknown hook fails the rehearsal. PYTHONPATH as device_run.sh sets it (the wheels there).
WHEELS=$(mktemp -d)
trap 'rm -rf "$WHEELS"' EXIT
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$WHEELS" "$WHEELS_FROM"/*.whl
PYTHONPATH="$WHEELS:$PWD" python3 -m pytest -qq -p no:cacheprovider --collect-only tests/offload_core -k cuda
WHEELS_DIR="$WHEELS_FROM" bash bench/device_run.sh "$@"
python3 -c "import json, sys; json.load(open(sys.argv[1]))['summary']" "$OUT/gpu_check.json"
# The sub-benches gpu_check runs on CUDA only (its CPU mode skips them), run here on CPU under the image's
# torch, ~75 s: a call torch 2.11 lacks would lose their rows on the device. What is checked is that each
# ran to its JSON line, not its verdict (hook_cost exits 1 over its CPU target on a busy VM).
for bench in "gpu_activations.py" "hook_cost.py --quick" "widen_cost.py --repeats 1"; do
  log="$OUT/rehearsal-${bench%%.py*}.log"
  PYTHONPATH="$WHEELS:$PWD" python3 bench/$bench > "$log" 2>&1 || echo "device_rehearsal: bench/$bench exited $? on CPU"
  tail -1 "$log" | python3 -c "import json, sys; json.loads(sys.stdin.read())" \
    || { echo "device_rehearsal: bench/$bench printed no JSON line under the image's torch (see $log)"; exit 1; }
done
echo "device_rehearsal: passed; what the device run leaves in \$OUT is in $OUT: $(ls "$OUT" | tr '\n' ' ')"
