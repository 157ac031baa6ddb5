#!/usr/bin/env bash
# GPU path check (issue 7, part 4): deadpool_ext snapshots of a ~1.3B-parameter GPT on one NVIDIA GPU -
# device-to-host copies into pinned buffers on a side CUDA stream overlapped with training, step-time ratio with
# and without snapshots at interval 1 (A/B interleaved), blocking time per snapshot. Under 8 minutes.
#
#   bash benchmarks/gpu_check.sh                   # results in $DEADPOOL_GPU_OUT, else $OUT, else ./gpu_check_out
#   DEADPOOL_GPU_OUT=/tmp/r bash benchmarks/gpu_check.sh --layers 24 --hidden 2048
#
# Needs a CUDA build of torch, deepspeed and transformers in the active Python (scripts/setup.sh with
# DEADPOOL_GPU=1, or the .venv if it has them). Exits 2 at once, with a message, when there is no CUDA device.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python}"
if [ -x .venv/bin/python ] && [ -z "${PYTHON:-}" ]; then PY=.venv/bin/python; fi
if ! command -v nvidia-smi >/dev/null 2>&1; then
  echo "gpu_check: nvidia-smi not found: no NVIDIA driver here. Nothing measured." >&2
  exit 2
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  echo "gpu_check: $PY has no CUDA-enabled torch (or it sees no device). Nothing measured." >&2
  exit 2
fi
# A hard stop below 8 minutes whatever happens; the script itself stops starting rounds at --budget-s.
exec timeout --signal=INT --kill-after=15 460 "$PY" benchmarks/gpu_check.py "$@"
