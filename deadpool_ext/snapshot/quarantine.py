"""A version quarantined in the memory tiers (the numerical canary: ``recovery/canary.py`` decides,
``integrations/canary.py`` acts): every rank marks the copies of it that it holds as bad, so that no rank reports
it to a restore again and the agreement (``plan.choose_version``) can only choose an older version.

Marking a copy bad replaces its MAGIC with ``format.QUARANTINED``: a restore's scan then refuses it ("quarantined by
the numerical canary", ``slots.probe_slot``) and never lists it; the next snapshot into that slot or buffer
invalidates and overwrites it as usual.
Each rank marks what it holds in its node's directory:

- its own tier-1 slots and differential ring entries (``deadpool.<job>.snap|diff.r<rank>.<i>``);
- the tier-2 replicas it holds for other ranks (``deadpool.<job>.replica|dreplica.r<src>.h<rank>b<buf>``).

A version newer than the failed one descends from it (snapshots taken during the check, or copies of a newer
step not every rank had): those are marked too. Every rank marks the same version at the same point (the
verdict is agreed), so together they mark every copy in memory. The versions a rank quarantined are also kept
in a small JSON record in its node's directory (``deadpool.<job>.quarantine.r<rank>.json``): a restarted process
counts them (the crash-loop guard).
"""
from __future__ import annotations

import contextlib
import json
import os
from typing import Any

from ..memory.shm import ShmSegment
from . import format as fmt
from .slots import probe_slot
from .tier1 import DIFF_KIND, REPLICA_KIND, SLOT_KIND

__all__ = ["mark_bad", "read_record", "write_record"]

MAX_RECORD_BYTES = 64 << 10
_OWN = (SLOT_KIND, DIFF_KIND)
_HELD = (REPLICA_KIND, "d" + REPLICA_KIND)


def mark_bad(directory: str, job_id: str, rank: int, version: int) -> list[str]:
    """Zero the MAGIC of every copy of ``version``, and of any newer version (taken from it), that ``rank`` holds
    in ``directory``; the files marked."""
    marked: list[str] = []
    if not os.path.isdir(directory):
        return marked
    for fname in sorted(os.listdir(directory)):
        parts = fname.split(".")
        if len(parts) != 5 or parts[0] != "deadpool" or parts[1] != job_id:
            continue
        own = parts[2] in _OWN and parts[3] == f"r{rank}"
        held = parts[2] in _HELD and parts[4].startswith(f"h{rank}b")
        if not (own or held):
            continue
        try:
            seg = ShmSegment.open(fname, root=directory)
        except OSError:  # gone or refused (not this user's, a link): nothing of it will be restored either
            continue
        try:
            meta, _ = probe_slot(seg.buf, verify=False)
            if meta is not None and int(meta["version"]) >= version:
                seg.buf[fmt.MAGIC_SLICE] = fmt.QUARANTINED
                marked.append(fname)
        finally:
            seg.close()
    return marked


def _record_path(directory: str, job_id: str, rank: int) -> str:
    return os.path.join(directory, f"deadpool.{job_id}.quarantine.r{int(rank)}.json")


def read_record(directory: str, job_id: str, rank: int) -> tuple[int, ...]:
    """The versions ``rank`` quarantined in this job (its record; none when absent or unreadable)."""
    path = _record_path(directory, job_id, rank)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:
        return ()
    try:
        data = os.read(fd, MAX_RECORD_BYTES + 1)
    finally:
        os.close(fd)
    try:
        rec: Any = json.loads(data) if len(data) <= MAX_RECORD_BYTES else None
    except ValueError:
        return ()
    versions = rec.get("versions") if isinstance(rec, dict) else None
    if not isinstance(versions, list) or not all(type(v) is int and v >= 0 for v in versions):
        return ()
    return tuple(sorted(set(versions)))


def write_record(directory: str, job_id: str, rank: int, versions: tuple[int, ...]) -> None:
    """Replace ``rank``'s record with ``versions`` (a temporary name, then renamed)."""
    path = _record_path(directory, job_id, rank)
    tmp = path + ".tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, json.dumps({"versions": sorted(set(versions))}).encode())
    finally:
        os.close(fd)
    try:
        os.replace(tmp, path)
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
