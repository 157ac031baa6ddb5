"""What a tier-3 base looks like on storage, how it is declared complete, verified and garbage-collected.

A base of version N (= optimizer step) is a plain DeepSpeed checkpoint directory plus the extension's JSON::

    <url>/latest                                   DeepSpeed's pointer; written only at publish
    <url>/zero_to_fp32.py, zero_to_torch.py        DeepSpeed's recovery scripts (copied once)
    <url>/global_stepN/                            DeepSpeed's own file names and torch.save payloads
        zero_pp_rank_R_mp_rank_00_{model,optim}_states.pt   (ZeRO-3; ZeRO-1/2: mp_rank_00_model_states.pt + ...)
        deadpool_manifest.rankR.json               per rank: its files, sizes, xxh3-64 (written after its data)
        deadpool_commit.json                       coordinator, LAST: every rank's files merged + layout

Publish order: data files (temporary names, renamed) -> each rank's manifest -> (coordinator, once every rank's
manifest is there) commit record -> ``latest``. A directory without ``deadpool_commit.json`` is never treated
as a base, so a half-written base cannot be picked up. JSON only: nothing the extension writes is pickled.
"""
from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import xxhash

from .storage import Storage

FORMAT = "deadpool-tier3/1"
COMMIT = "deadpool_commit.json"
LATEST = "latest"
_TAG = re.compile(r"^global_step(\d+)$")

Progress = Callable[[int, int], None]


def version_tag(version: int) -> str:
    return f"global_step{version}"


def parse_tag(name: str) -> int | None:
    m = _TAG.match(name)
    return int(m.group(1)) if m else None


def rank_manifest_name(rank: int) -> str:
    # Same prefix as persist.atomic's manifests, so DeadpoolCheckpointEngine.load() verifies files against it.
    return f"deadpool_manifest.rank{rank}.json"


@dataclass(slots=True)
class VersionInfo:
    version: int
    tag: str
    commit: dict[str, Any] | None

    @property
    def complete(self) -> bool:
        return self.commit is not None

    @property
    def nbytes(self) -> int:
        return int(self.commit["total_bytes"]) if self.commit else 0


def read_json(storage: Storage, rel: str) -> dict[str, Any] | None:
    try:
        out: dict[str, Any] | None = json.loads(storage.read_bytes(rel))
        return out
    except (FileNotFoundError, ValueError, OSError):
        return None


def read_commit(storage: Storage, tag: str) -> dict[str, Any] | None:
    rec = read_json(storage, f"{tag}/{COMMIT}")
    if rec is None or rec.get("format") != FORMAT or "files" not in rec:
        return None
    return rec


def read_latest(storage: Storage) -> str | None:
    try:
        return storage.read_bytes(LATEST).decode().strip() or None
    except (FileNotFoundError, OSError):
        return None


def list_versions(storage: Storage) -> list[VersionInfo]:
    """Every ``global_stepN`` directory, oldest first, with its commit record (None: incomplete)."""
    out = []
    for name in storage.listdir(""):
        v = parse_tag(name)
        if v is not None:
            out.append(VersionInfo(v, name, read_commit(storage, name)))
    return sorted(out, key=lambda i: i.version)


def load_candidates(storage: Storage) -> list[VersionInfo]:
    """Complete versions a resume may use, newest first. ``latest`` is honoured as an upper bound when it names
    a complete version: it only ever moves forward at publish, so it differs from the newest commit record
    only when a user pinned an older base on purpose (DeepSpeed's own convention) or a publish was cut between
    the commit record and ``latest`` (then the older base is equally consistent)."""
    complete = [v for v in list_versions(storage) if v.complete]
    pin = parse_tag(read_latest(storage) or "")
    if pin is not None and any(v.version == pin for v in complete):
        complete = [v for v in complete if v.version <= pin]
    return sorted(complete, key=lambda i: -i.version)


def checksum_stream(chunks: Any) -> tuple[int, str]:
    h = xxhash.xxh3_64()
    n = 0
    for block in chunks:
        h.update(block)
        n += len(block)
    return n, h.hexdigest()


def verify_version(storage: Storage, info: VersionInfo, names: list[str] | None = None,
                   progress: Progress | None = None) -> list[str]:
    """Check sizes and checksums of ``names`` (default: every file of the base); return one message per bad
    file (empty: verified). Each message names the file and what is wrong."""
    assert info.commit is not None
    files: dict[str, dict[str, Any]] = info.commit["files"]
    todo = sorted(files) if names is None else names
    total = sum(int(files[n]["nbytes"]) for n in todo if n in files)
    done = 0
    errors = []
    for name in todo:
        rel = f"{info.tag}/{name}"
        entry = files.get(name)
        if entry is None:
            errors.append(f"{storage.url.rstrip('/')}/{rel}: not listed in {COMMIT}")
            continue
        if not storage.exists(rel):
            errors.append(f"{storage.url.rstrip('/')}/{rel}: listed in {COMMIT} but missing")
            continue
        if storage.size(rel) != int(entry["nbytes"]):
            errors.append(f"{storage.url.rstrip('/')}/{rel}: size {storage.size(rel)} != {entry['nbytes']} in the "
                          f"manifest (truncated or corrupt file)")
            continue
        _, digest = checksum_stream(storage.iter_chunks(rel))
        if digest != entry["xxh3_64"]:
            errors.append(f"{storage.url.rstrip('/')}/{rel}: checksum does not match the manifest (corrupt file)")
        done += int(entry["nbytes"])
        if progress is not None:
            progress(done, total)
    return errors


def build_commit(version: int, rank_manifests: dict[int, dict[str, Any]], layout: dict[str, Any],
                 write_s: float) -> dict[str, Any]:
    files: dict[str, dict[str, Any]] = {}
    for rank, man in sorted(rank_manifests.items()):
        for name, entry in man["files"].items():
            files[name] = {**entry, "rank": rank}
    return {"format": FORMAT, "version": version, "tag": version_tag(version), "files": files,
            "total_bytes": sum(int(e["nbytes"]) for e in files.values()), "published_at": time.time(),
            "write_s": write_s, **layout}


def collect_garbage(storage: Storage, keep_last: int, log: Callable[[str], None]) -> list[str]:
    """Delete complete bases beyond the newest ``keep_last`` and abandoned partial ones older than the newest
    complete base. Called by the coordinator only after it published *and verified* a new base, so the newest
    recoverable version is never deleted (``keep_last >= 1``). Returns the deleted tags."""
    versions = list_versions(storage)
    complete = [v for v in versions if v.complete]
    if not complete:
        return []
    keep = {v.version for v in complete[-max(1, keep_last):]}
    newest = complete[-1].version
    deleted = []
    for v in versions:
        if v.version in keep:
            continue
        if v.complete or v.version < newest:
            # Commit record first: a crash halfway through leaves an incomplete (ignored) directory, never a
            # "complete" base with files missing.
            storage.remove(f"{v.tag}/{COMMIT}")
            storage.remove_tree(v.tag)
            deleted.append(v.tag)
            log(f"tier 3: deleted {'base' if v.complete else 'abandoned partial base'} {v.tag} "
                f"(keep_last={keep_last}, newest complete {version_tag(newest)})")
    return deleted
