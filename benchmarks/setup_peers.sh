#!/usr/bin/env bash
# What the peer columns of bench_snapshot_overhead / bench_peers need, so every peer runs at its best in every run:
#   * DLRover's flash checkpoint (dlrover 0.6.1 and grpcio, from PyPI; not in requirements.txt: a benchmark peer,
#     not a dependency of deadpool_ext);
#   * DeepSpeed's decoupled writer in its FAST mode, which needs DeepSpeed's async_io op, which needs libaio
#     (Debian's libaio-dev; installed when this runs as root with apt-get, else the command to run is printed).
# Idempotent; run from the repository root with the project's venv:  bash benchmarks/setup_peers.sh
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || { echo "[setup_peers] no .venv: run 'bash scripts/setup.sh --no-run' first" >&2; exit 2; }
. .venv/bin/activate
if ! python -c "import dlrover, grpc" 2>/dev/null; then
  echo "[setup_peers] installing dlrover==0.6.1 and grpcio (DLRover flash checkpoint)"
  pip install -q "dlrover==0.6.1" grpcio 2>&1 | grep -v "^WARNING: Location" || true
fi
if [ ! -e /usr/include/libaio.h ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "[setup_peers] installing libaio-dev (Debian) for DeepSpeed's async_io op (the decoupled writer's FAST mode)"
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libaio-dev) >/dev/null
  else
    echo "[setup_peers] libaio-dev is missing: run 'sudo apt-get install libaio-dev' (else ds_decoupled runs its PYTHON writer, said in the results)" >&2
  fi
fi
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$PWD/.cache/torch_extensions}" DS_ACCELERATOR="${DS_ACCELERATOR:-cpu}"
python - <<'PY'
import os
import dlrover  # noqa: F401
from deepspeed.ops.op_builder import AsyncIOBuilder
fast = AsyncIOBuilder().is_compatible(verbose=False)
if fast and not os.path.exists(os.path.join(os.environ["TORCH_EXTENSIONS_DIR"], "async_io", "async_io.so")):
    # built once here, not inside a timed job: the writer processes of every rank would otherwise compile it at
    # their start (8 minutes on 2 busy cores), racing for the build lock
    print("[setup_peers] building DeepSpeed's async_io op once (minutes; cached in $TORCH_EXTENSIONS_DIR)", flush=True)
    AsyncIOBuilder().load()
print(f"[setup_peers] dlrover {dlrover.__version__ if hasattr(dlrover, '__version__') else 'ok'}; "
      f"DeepSpeed async_io {'compatible: the decoupled writer runs FAST' if fast else 'NOT compatible: PYTHON writer'}")
PY
