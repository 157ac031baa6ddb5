#!/usr/bin/env bash
# The whole test suite (what CI runs): installs into .venv/ if needed, runs the gates, then pytest.
#   bash scripts/test.sh            # everything
#   bash scripts/test.sh -m 'not slow'   # unit tests only (seconds)
#   DEADPOOL_SKIP_GATES=1 bash scripts/test.sh -m 'not slow'   # pytest only, for a quick local run
# Gates, in this order, configured in pyproject.toml: `ruff check .` (lint), `mypy` (strict on the core
# packages), `lint-imports` (layering contracts). Each prints one line; the first to fail stops the script
# with that tool's output and its exit status. CI does not set DEADPOOL_SKIP_GATES.
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
# The metrics endpoint is tested against a real Prometheus server (Debian's prometheus, started on loopback by
# tests/integration/test_metrics_prometheus.py, which skips with one line where it is missing).
if ! command -v prometheus >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "[test] installing prometheus (Debian) for the metrics endpoint test"
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus) \
      >/dev/null
  else
    echo "[test] prometheus is not installed: run 'sudo apt-get install prometheus' (the metrics test needs it)" >&2
  fi
fi
# The Slurm tests (tests/multihost/test_slurm.py) run a real slurmctld and slurmd's (Debian's slurm-wlm, with munge)
# on the namespace hosts; they skip with one line where it is not installed.
if ! command -v slurmctld >/dev/null 2>&1 || ! command -v munged >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "[test] installing slurm-wlm and munge (Debian) for the Slurm tests"
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends slurm-wlm munge) \
      >/dev/null
  else
    echo "[test] slurm-wlm is not installed: run 'sudo apt-get install slurm-wlm munge' (the Slurm tests need it)" >&2
  fi
fi
. .venv/bin/activate
gate() {
  local name=$1 out
  shift
  if out=$("$@" 2>&1); then
    echo "[test] $name: ok"
  else
    local rc=$?
    printf '%s\n' "$out" >&2
    echo "[test] $name: FAILED (exit $rc)" >&2
    exit "$rc"
  fi
}
if [ "${DEADPOOL_SKIP_GATES:-0}" = "1" ]; then
  echo "[test] gates skipped (DEADPOOL_SKIP_GATES=1)"
else
  # This checkout's deadpool_ext first on the path for the type and import checks, whatever else is installed
  # (the pytest run below keeps the environment as it was).
  pp="$PWD${PYTHONPATH:+:$PYTHONPATH}"
  gate ruff ruff check .
  gate mypy env PYTHONPATH="$pp" mypy
  gate lint-imports env PYTHONPATH="$pp" lint-imports
fi
export TORCH_EXTENSIONS_DIR="$PWD/.cache/torch_extensions" DS_ACCELERATOR="${DS_ACCELERATOR:-cpu}"
# The 25 slowest tests are listed at the end: what to look at when the suite nears CI's 30 minutes.
exec python -m pytest -q -p no:cacheprovider --durations=25 "$@"
