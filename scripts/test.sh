#!/usr/bin/env bash
# The whole test suite (what CI runs): installs into .venv/ if needed, then pytest.
#   bash scripts/test.sh            # everything
#   bash scripts/test.sh -m 'not slow'   # unit tests only (seconds)
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --no-run
# The etcd store backend is tested against a real etcd server (Debian's etcd-server, started on loopback by
# the tests themselves).
if ! command -v etcd >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "[test] installing etcd-server (Debian) for the etcd store tests"
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq etcd-server) >/dev/null
  else
    echo "[test] etcd is not installed: run 'sudo apt-get install etcd-server' (the etcd store tests need it)" >&2
  fi
fi
. .venv/bin/activate
export TORCH_EXTENSIONS_DIR="$PWD/.cache/torch_extensions" DS_ACCELERATOR="${DS_ACCELERATOR:-cpu}"
exec python -m pytest -q -p no:cacheprovider "$@"
