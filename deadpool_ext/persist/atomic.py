"""Atomic file publication and manifests.

A checkpoint file is written to a temporary name in the same directory, fsynced, and renamed into place;
the manifest listing every file with its size and checksum is written the same way, last. A reader that
finds no manifest, or a file whose bytes do not match it, treats the checkpoint as incomplete.

Manifests are read strictly (:mod:`deadpool_ext.persist.records`): bounded UTF-8 JSON objects whose file names
are plain single components (or match the caller's ``names`` patterns) before any path join; with a checkpoint
key (:mod:`deadpool_ext.persist.sign`) they are signed at write and an unsigned or forged one is refused.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Sequence
from typing import IO, Any

import xxhash

from . import sign
from .records import (
    PLAIN_NAME,
    BadRecordError,
    check_name,
    parse_file_entries,
    parse_json_object,
    read_capped,
)
from .regular import NotRegularFileError, open_regular_file

MANIFEST_PREFIX = "deadpool_manifest"
_MANIFEST_FILE = re.compile(rf"^{MANIFEST_PREFIX}\.[A-Za-z0-9_-]{{1,64}}\.json$", re.ASCII)


class IncompleteCheckpointError(RuntimeError):
    """A checkpoint is missing files, has no manifest, or a file's checksum does not match."""


def file_checksum(path: str, chunk: int = 8 << 20) -> str:
    h = xxhash.xxh3_64()
    with open_regular_file(path) as fh:
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


def write_manifest(directory: str, name: str, files: list[str], extra: dict[str, Any] | None = None, *,
                   key: bytes | None = None) -> str:
    """Record size and checksum of ``files`` (relative to ``directory``) in ``<MANIFEST_PREFIX>.<name>.json``,
    signed with ``key`` when one is given."""
    entries = {}
    for rel in sorted(files):
        full = os.path.join(directory, rel)
        entries[rel] = {"nbytes": os.path.getsize(full), "xxh3_64": file_checksum(full)}
    rec = sign.sign({"files": entries, **(extra or {})}, sign.KIND_MANIFEST, key)
    body = json.dumps(rec, indent=1, sort_keys=True).encode()
    path = os.path.join(directory, f"{MANIFEST_PREFIX}.{name}.json")
    atomic_write(path, lambda fh: fh.write(body))
    return path


PLAIN_ALLOWED = "a plain file name: letters, digits, '_', '-', '.'; not '.' or '..'"


def parse_manifest(data: bytes, here: str, *, key: bytes | None = None,
                   names: Sequence[re.Pattern[str]] = (PLAIN_NAME,), allowed: str = PLAIN_ALLOWED) -> dict[str, Any]:
    """One manifest from its bytes: validated, names checked against ``names``, with ``key`` authenticated."""
    rec = parse_json_object(data, here)
    # A tier-3 base's per-rank manifests share the prefix and the shape: accepted as manifests of their files.
    sign.check(rec, (sign.KIND_MANIFEST, sign.KIND_RANK_MANIFEST), key, here)
    if "files" not in rec:
        raise BadRecordError(f"{here}: field 'files' is missing")
    files = parse_file_entries(rec["files"], here, lambda n: check_name(n, here, names, allowed))
    return {**rec, "files": files}


def read_manifest_records(directory: str, *, key: bytes | None = None,
                          names: Sequence[re.Pattern[str]] = (PLAIN_NAME,),
                          allowed: str = PLAIN_ALLOWED) -> dict[str, dict[str, Any]]:
    """Every manifest in ``directory``, parsed (see :func:`parse_manifest`): manifest file name -> record."""
    out: dict[str, dict[str, Any]] = {}
    if not os.path.isdir(directory):
        return out
    for fname in sorted(os.listdir(directory)):
        if not (fname.startswith(MANIFEST_PREFIX) and fname.endswith(".json")):
            continue
        here = os.path.join(directory, fname)
        if not _MANIFEST_FILE.fullmatch(fname):
            raise BadRecordError(f"{here}: not a manifest name the writer writes ({MANIFEST_PREFIX}.<name>.json)")
        with open_regular(here) as fh:
            out[fname] = parse_manifest(read_capped(fh, here), here, key=key, names=names, allowed=allowed)
    return out


def read_manifests(directory: str, *, key: bytes | None = None,
                   names: Sequence[re.Pattern[str]] = (PLAIN_NAME,),
                   allowed: str = PLAIN_ALLOWED) -> dict[str, dict[str, Any]]:
    """All manifests in ``directory`` merged: relative file name -> {nbytes, xxh3_64}. Raises
    :class:`~deadpool_ext.persist.records.BadRecordError` (or ``SignatureError`` with a key) naming a bad one."""
    merged: dict[str, dict[str, Any]] = {}
    for rec in read_manifest_records(directory, key=key, names=names, allowed=allowed).values():
        merged.update(rec["files"])
    return merged


def open_regular(path: str) -> IO[bytes]:
    """``path`` opened for reading, refusing a symbolic link or anything but a regular file (a FIFO, a device or a
    socket: ``NotRegularFileError``, never opened; a directory: `IncompleteCheckpointError`)."""
    try:
        return open_regular_file(path)
    except IsADirectoryError:
        raise IncompleteCheckpointError(f"{path}: not a regular file") from None


def open_verified(path: str, manifest: dict[str, dict[str, Any]]) -> IO[bytes]:
    """``path`` opened for reading once its bytes matched its manifest entry, positioned at the start.

    The checksum is computed through the same open file that is returned, so what the caller reads is what
    was checked even if the name is replaced in between (a rename swaps the name, not this file). Raises
    :class:`IncompleteCheckpointError` unless ``path`` is listed, a regular file (not a link) and matches."""
    rel = os.path.basename(path)
    entry = manifest.get(rel)
    if entry is None:
        raise IncompleteCheckpointError(f"{path}: not listed in any {MANIFEST_PREFIX}.*.json (incomplete checkpoint)")
    try:
        fh = open_regular(path)
    except FileNotFoundError:
        raise IncompleteCheckpointError(f"{path}: listed in the manifest but missing") from None
    except NotRegularFileError as exc:   # a FIFO, device or socket: never opened
        raise IncompleteCheckpointError(str(exc)) from None
    except OSError as exc:  # ELOOP: a symbolic link
        raise IncompleteCheckpointError(f"{path}: cannot be opened as a regular file ({exc.strerror})") from None
    try:
        h = xxhash.xxh3_64()
        n = 0
        while block := fh.read(8 << 20):
            h.update(block)
            n += len(block)
        if n != entry["nbytes"] or h.hexdigest() != entry["xxh3_64"]:
            raise IncompleteCheckpointError(f"{path}: size or checksum does not match the manifest (corrupt file)")
        fh.seek(0)
        return fh
    except BaseException:
        fh.close()
        raise


def verify_file(path: str, manifest: dict[str, dict[str, Any]]) -> None:
    """Raise :class:`IncompleteCheckpointError` unless ``path`` is listed and its bytes match."""
    open_verified(path, manifest).close()
