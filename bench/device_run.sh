#!/usr/bin/env bash
# What a lent GPU machine runs, as the one prepared command: `bash bench/device_run.sh --require-cuda`,
# with the diffusers wheels in .whl/ carried along (../shared/gpu-wheels/README.md: that machine has CUDA
# torch but no diffusers, no Ray and no network). Arguments go to bench/gpu_check.sh.
#
# Everything it learns lands under $OUT, which comes back whole: the device tool returns only the last
# 12,000 characters of output, and gpu_check's JSON line nears that alone (9,522 characters on the H200
# at 4ed5bc7; since then the calibration's rows carry every call's peak, 6.1 KB of gpu_activations JSON
# on CPU, and hook_cost its profile, 2.5 KB). So: machine.txt (the GPU, torch, the host's CPU and caches:
# the fill probe sizes its source by the last-level cache), gpu_check.log (all of it) and gpu_check.json
# (its last line). bench/device_rehearsal.sh runs this on CPU first.
set -uo pipefail
cd "$(dirname "$0")/.."
: "${OUT:?bench/device_run.sh writes its results under \$OUT}"
WHEELS_FROM="${WHEELS_DIR:-.whl}"
WHEELS=$(mktemp -d)
trap 'rm -rf "$WHEELS"' EXIT
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$WHEELS" \
  "$WHEELS_FROM"/*.whl || exit
export PYTHONPATH="$WHEELS:$PWD" PYTHONUNBUFFERED=1
{
  if command -v nvidia-smi > /dev/null; then nvidia-smi -L; else echo "nvidia-smi: none"; fi
  python3 -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda)"
  echo "cpus: $(nproc)"
  lscpu 2>/dev/null | grep -E "^(Model name|Socket|Core|Thread|NUMA node\(s\)|L3)" || true
  grep -H . /sys/devices/system/cpu/cpu0/cache/index*/{level,size,shared_cpu_list} 2>/dev/null \
    || echo "sysfs: no cache folders (gVisor serves none)"
  grep -m 2 -E "^(model name|cache size)" /proc/cpuinfo || true
} > "$OUT/machine.txt"
cat "$OUT/machine.txt"
PYTHON=python3 bash bench/gpu_check.sh "$@" 2>&1 | tee "$OUT/gpu_check.log"
status=${PIPESTATUS[0]}
tail -n 1 "$OUT/gpu_check.log" > "$OUT/gpu_check.json"
exit "$status"
