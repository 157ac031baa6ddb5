#!/usr/bin/env bash
# One command from a fresh clone: create .venv/, install everything, then run the main job
# (4-rank CPU GPT pretraining, DeepSpeed ZeRO-3, deadpool_ext on) and print its summary.
#
#   bash scripts/setup.sh            # install + main job
#   bash scripts/setup.sh --no-run   # install only (what scripts/test.sh uses)
#   DEADPOOL_GPU=1 bash scripts/setup.sh   # CUDA torch build from PyPI instead of the CPU pin
set -euo pipefail
cd "$(dirname "$0")/.."
RUN=1
[ "${1:-}" = "--no-run" ] && RUN=0

PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null 2>&1 || PY=python3
if [ ! -x .venv/bin/python ]; then
  echo "[setup] creating .venv with $($PY --version)"
  "$PY" -m venv .venv
fi
. .venv/bin/activate
stamp=.venv/.deadpool_installed
if [ ! -f "$stamp" ] || [ setup.py -nt "$stamp" ] || [ requirements.txt -nt "$stamp" ]; then
  echo "[setup] installing packages into .venv (torch first: pinned, so nothing pulls a multi-GB CUDA build)"
  pip install -q --upgrade pip setuptools wheel
  if [ "${DEADPOOL_GPU:-0}" = "1" ]; then
    pip install -q "torch==2.13.0"          # CUDA build from PyPI
  else
    pip install -q "torch==2.13.0"          # these machines carry the CPU build of 2.13.0 locally
  fi
  DS_BUILD_OPS=0 pip install -q -r requirements.txt
  pip install -q --no-build-isolation -e .
  touch "$stamp"
fi
python -c "import torch, deepspeed, deadpool_ext; print('[setup] torch', torch.__version__, '| deepspeed', deepspeed.__version__, '| deadpool_ext', deadpool_ext.__version__)"

if [ "$RUN" = 1 ]; then
  export TORCH_EXTENSIONS_DIR="$PWD/.cache/torch_extensions" DS_ACCELERATOR="${DS_ACCELERATOR:-cpu}"
  mkdir -p runs
  rm -f runs/main_metrics.jsonl
  echo "[setup] main job: 4-rank GPT pretraining, ZeRO-3, deadpool_ext snapshots every step (first run compiles DeepSpeed's CPU comm op, ~30 s)"
  python -m torch.distributed.run --nproc-per-node 4 --master-addr 127.0.0.1 --master-port "${MASTER_PORT:-29500}" \
    scripts/pretrain_gpt.py --deepspeed_config configs/gpt_tiny_zero3_cpu_2nodes.json \
    --train-iters 30 --model-size tiny --metrics-out runs/main_metrics.jsonl 2>&1 \
    | grep -E '^\[pretrain|^\[deadpool r0\]|Error|error' || true
  python - <<'PY'
import json
rows = [json.loads(l) for l in open("runs/main_metrics.jsonl")]
assert rows and rows[-1]["step"] == 30, "main job did not complete 30 steps (see output above)"
print(f"[setup] main job OK: {len(rows)} steps, loss {rows[0]['loss']:.4f} -> {rows[-1]['loss']:.4f}; metrics in runs/main_metrics.jsonl")
PY
fi
