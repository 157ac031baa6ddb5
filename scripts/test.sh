#!/usr/bin/env bash
# The whole test suite (what CI runs): installs into .venv/ if needed, then pytest.
#   bash scripts/test.sh            # everything
#   bash scripts/test.sh -m 'not slow'   # unit tests only (seconds)
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --no-run
. .venv/bin/activate
export TORCH_EXTENSIONS_DIR="$PWD/.cache/torch_extensions" DS_ACCELERATOR="${DS_ACCELERATOR:-cpu}"
exec python -m pytest -q -p no:cacheprovider "$@"
