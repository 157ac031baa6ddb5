"""The one cache of baselines: the losses of an uninterrupted run, which the bit-identity tests compare against.

A baseline is keyed by everything that decides its trajectory, and by nothing else:

- the script (its path and its bytes) and its arguments (steps, seed, model size, ...), the wrapper module if any;
- the config's digest, without ``deadpool.local.shm_root`` (where tier-1 memory lives is a per-test path, and no
  loss depends on it);
- the ranks (the world size the job starts with) and the job's added environment;
- the digest of the package's source (``deadpool_ext/`` and ``patches/``), the versions of Python, torch,
  DeepSpeed, Megatron-Core and transformers, and the standard library's path (the demo's corpus is its sources).

Which launcher ran it, the metrics path, the timeline, spares and ports are not part of the key: a launcher that
changed a loss would be the bug those tests exist to catch. The launcher is the caller's: :meth:`BaselineCache.get`
runs the caller's ``run(job)`` on a miss.

Baselines live in memory for the process and as JSON files under ``.cache/baselines/`` (``DEADPOOL_BASELINE_DIR``
names another directory; ``off`` keeps them in memory only), so a rerun of an unchanged tree reuses them; any
change to the source, the script or the config is a different key.
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import platform
import sysconfig
import tempfile
from collections.abc import Callable
from functools import cache

from .jobs import Job
from .launch import REPO

DIR_ENV = "DEADPOOL_BASELINE_DIR"
_VERSIONED = ("torch", "deepspeed", "megatron-core", "transformers", "numpy")


@cache
def source_digest(root: str = REPO) -> str:
    """sha256 over the package's Python source and the patches (paths and bytes, in sorted order)."""
    h = hashlib.sha256()
    for top in ("deadpool_ext", "patches"):
        for d, dirs, files in sorted(os.walk(os.path.join(root, top))):
            dirs.sort()
            for name in sorted(files):
                if name.endswith(".py"):
                    path = os.path.join(d, name)
                    h.update(os.path.relpath(path, root).encode() + b"\0")
                    with open(path, "rb") as fh:
                        h.update(hashlib.sha256(fh.read()).digest())
    return h.hexdigest()


def _version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _file_digest(path: str) -> str:
    with open(path if os.path.isabs(path) else os.path.join(REPO, path), "rb") as fh:
        return hashlib.sha256(fh.read()).hexdigest()


def config_digest(path: str) -> str:
    """The config's digest without ``deadpool.local.shm_root`` (canonical JSON)."""
    with open(path) as fh:
        cfg = json.load(fh)
    local = cfg.get("deadpool", {}).get("local") if isinstance(cfg.get("deadpool"), dict) else None
    if isinstance(local, dict):
        local.pop("shm_root", None)
    return hashlib.sha256(json.dumps(cfg, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def key_of(job: Job) -> str:
    """The digest of everything that decides the job's trajectory (the module docstring lists it)."""
    parts = {
        "script": job.script,
        "script_sha256": _file_digest(job.script) if job.script.endswith(".py") else None,
        "wrap": job.wrap,
        "args": list(job.args),
        "config_flag": job.config_flag if job.config is not None else None,
        "config_sha256": config_digest(job.config) if job.config is not None else None,
        "ranks": job.ranks,
        "env": dict(sorted(job.env_vars.items())),
        "source_sha256": source_digest(),
        "python": platform.python_version(),
        "stdlib": sysconfig.get_paths()["stdlib"],
        "machine": platform.machine(),
        "versions": {name: _version(name) for name in _VERSIONED},
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


class BaselineCache:
    """step -> loss of uninterrupted runs, by :func:`key_of`; in memory, and on disk unless ``directory`` is None."""

    def __init__(self, directory: str | None) -> None:
        self.directory = directory
        self.runs: dict[str, dict[int, float]] = {}

    def get(self, job: Job, run: Callable[[Job], dict[int, float]]) -> dict[int, float]:
        """The baseline of ``job``: cached, or ``run(job)`` (which checks the run ended well and returns its
        step -> loss), then cached."""
        key = key_of(job)
        if key not in self.runs:
            self.runs[key] = self._load(key) or self._store(key, run(job))
        return self.runs[key]

    def _path(self, key: str) -> str | None:
        return os.path.join(self.directory, f"{key}.json") if self.directory else None

    def _load(self, key: str) -> dict[int, float] | None:
        path = self._path(key)
        if path is None or not os.path.exists(path):
            return None
        with open(path) as fh:
            return {int(step): float(loss) for step, loss in json.load(fh).items()}

    def _store(self, key: str, metrics: dict[int, float]) -> dict[int, float]:
        path = self._path(key)
        if path is not None and metrics:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".tmp-")
            with os.fdopen(fd, "w") as fh:  # float repr round-trips: the losses come back bit for bit
                json.dump({str(step): loss for step, loss in sorted(metrics.items())}, fh)
            os.replace(tmp, path)
        return metrics


def _default_dir() -> str | None:
    value = os.environ.get(DIR_ENV, "")
    if value == "off":
        return None
    return value or os.path.join(REPO, ".cache", "baselines")


BASELINES = BaselineCache(_default_dir())
"""The process's one baseline cache (tests, chaos, benchmarks share it)."""


def baseline(job: Job, run: Callable[[Job], dict[int, float]]) -> dict[int, float]:
    """``BASELINES.get(job, run)``."""
    return BASELINES.get(job, run)


__all__ = ["BASELINES", "BaselineCache", "DIR_ENV", "baseline", "config_digest", "key_of", "source_digest"]
