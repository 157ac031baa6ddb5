#!/usr/bin/env bash
# GPU device check (issue 33, parts 3-4): benchmarks/gpu_check.py's parts a-e on one NVIDIA GPU, under 8 minutes.
#
#   PYTHON=python3 bash benchmarks/gpu_check.sh              # results in $DEADPOOL_GPU_OUT, else $OUT, else
#                                                            # benchmarks/results/gpu
#   PYTHON=python3 bash benchmarks/gpu_check.sh --parts a,b  # a subset
#
# On the lent GPU machine use its own python3 with the wheels of ../shared/tools/gpu-wheels.sh on PYTHONPATH
# (../shared/notes/gpu.md has the exact command); never this repository's .venv (Python 3.11, CPU torch).
# Exits 2 at once, with one line, when there is no NVIDIA driver or no CUDA-enabled torch.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
if ! command -v nvidia-smi >/dev/null 2>&1; then
  echo "gpu_check: nvidia-smi not found: no NVIDIA driver here. Nothing measured." >&2
  exit 2
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  echo "gpu_check: $PY has no CUDA-enabled torch (or it sees no device). Nothing measured." >&2
  exit 2
fi
# A hard stop below 8 minutes whatever happens; every part has its own deadline inside (gpu_check.py PART_BUDGET_S).
exec timeout --signal=INT --kill-after=15 465 "$PY" benchmarks/gpu_check.py "$@"
