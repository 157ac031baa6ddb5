"""Atomic file publication and manifests.

A checkpoint file is written to a temporary name in the same directory, fsynced, and renamed into place;
the manifest listing every file with its size and checksum is written the same way, last. A reader that
finds no manifest, or a file whose bytes do not match it, treats the checkpoint as incomplete.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from typing import Any

import xxhash

MANIFEST_PREFIX = "deadpool_manifest"


class IncompleteCheckpointError(RuntimeError):
    """A checkpoint is missing files, has no manifest, or a file's checksum does not match."""


def file_checksum(path: str, chunk: int = 8 << 20) -> str:
    h = xxhash.xxh3_64()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            h.update(block)
    return h.hexdigest()


def atomic_write(path: str, write: Callable[[Any], None], *, fsync: bool = True) -> None:
    """Call ``write(fileobj)`` on a temporary file beside ``path`` and rename it into place."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    free = shutil.disk_usage(directory).free
    fd, tmp = tempfile.mkstemp(prefix=".tmp.", dir=directory)
    try:
        with os.fdopen(fd, "wb") as fh:
            write(fh)
            fh.flush()
            if fsync:
                os.fsync(fh.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        if os.path.exists(tmp):
            os.unlink(tmp)
        if exc.errno == 28:  # ENOSPC
            raise OSError(28, f"deadpool_ext: disk full while writing {path} ({free} bytes were free in "
                              f"{directory} before the write); the previous checkpoint is untouched") from exc
        raise
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def write_manifest(directory: str, name: str, files: list[str], extra: dict[str, Any] | None = None) -> str:
    """Record size and checksum of ``files`` (relative to ``directory``) in ``<MANIFEST_PREFIX>.<name>.json``."""
    entries = {}
    for rel in sorted(files):
        full = os.path.join(directory, rel)
        entries[rel] = {"nbytes": os.path.getsize(full), "xxh3_64": file_checksum(full)}
    body = json.dumps({"files": entries, **(extra or {})}, indent=1, sort_keys=True).encode()
    path = os.path.join(directory, f"{MANIFEST_PREFIX}.{name}.json")
    atomic_write(path, lambda fh: fh.write(body))
    return path


def read_manifests(directory: str) -> dict[str, dict[str, Any]]:
    """All manifests in ``directory`` merged: relative file name -> {nbytes, xxh3_64}."""
    merged: dict[str, dict[str, Any]] = {}
    if not os.path.isdir(directory):
        return merged
    for fname in sorted(os.listdir(directory)):
        if fname.startswith(MANIFEST_PREFIX) and fname.endswith(".json"):
            with open(os.path.join(directory, fname)) as fh:
                merged.update(json.load(fh)["files"])
    return merged


def verify_file(path: str, manifest: dict[str, dict[str, Any]]) -> None:
    """Raise :class:`IncompleteCheckpointError` unless ``path`` is listed and its bytes match."""
    rel = os.path.basename(path)
    entry = manifest.get(rel)
    if entry is None:
        raise IncompleteCheckpointError(f"{path}: not listed in any {MANIFEST_PREFIX}.*.json (incomplete checkpoint)")
    if not os.path.exists(path):
        raise IncompleteCheckpointError(f"{path}: listed in the manifest but missing")
    if os.path.getsize(path) != entry["nbytes"] or file_checksum(path) != entry["xxh3_64"]:
        raise IncompleteCheckpointError(f"{path}: size or checksum does not match the manifest (corrupt file)")
