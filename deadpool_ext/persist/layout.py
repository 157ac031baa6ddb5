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

Reading back (:mod:`deadpool_ext.persist.records`): commit records and rank manifests are parsed strictly
(:func:`parse_commit`, :func:`parse_rank_manifest`), every file name is checked against :func:`file_names`
(DeepSpeed's own names, from its naming functions) before any path join, a record listing no file is refused,
and with a checkpoint key (:mod:`deadpool_ext.persist.sign`) a record the key did not sign is refused. A present
but bad record makes its base *refused* (``VersionInfo.problem``, one line), never silently "incomplete".
"""
from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import xxhash

from . import sign
from .records import (
    BadRecordError,
    CheckpointTrustError,
    check_name,
    get_int,
    get_number,
    get_object,
    get_str,
    one_line,
    parse_file_entries,
    parse_json_object,
    read_capped,
)
from .regular import NotRegularFileError
from .storage import Storage

FORMAT = "deadpool-tier3/1"
COMMIT = "deadpool_commit.json"
QUARANTINE = "deadpool_quarantine.json"
"""A base whose values failed the numerical canary after a restore (``integrations/canary.py``): never loaded
again (:func:`load_candidates` refuses it); a later base of the same step, trained again from an older version,
replaces the directory and the mark with it."""
LATEST = "latest"
_TAG = re.compile(r"^global_step([0-9]{1,18})$", re.ASCII)
TAG_ALLOWED = "global_step<N> (N: 1 to 18 digits)"

@dataclass(frozen=True, slots=True)
class FileNames:
    """The file names a base may hold besides the JSON: one full-match regex each (a single path component),
    and how a refusal describes them."""

    patterns: tuple[re.Pattern[str], ...]
    allowed: str

    def check(self, name: object, where: str) -> str:
        return check_name(name, where, self.patterns, self.allowed)


# Where the names come from: the framework's own naming functions, handed in by its integration when it is imported
# (``integrations/deepspeed/names.py`` calls DeepSpeed's; the persist layer imports no framework; ``deadpool
# verify`` and ``inspect`` hand it in too whenever DeepSpeed imports, ``commands/_names.py``). Otherwise, e.g. those
# tools where DeepSpeed is not installed, FALLBACK_NAMES: the same names as DeepSpeed 0.19 writes them, which
# ``tests/unit/test_ds_wrappers_names.py`` checks against the derived rule.
_N = r"[0-9]{1,9}"
FALLBACK_NAMES = FileNames(patterns=tuple(re.compile(p, re.ASCII) for p in (
    rf"^mp_rank_{_N}_model_states\.pt$",
    rf"^(?:bf16_)?zero_pp_rank_{_N}_mp_rank_{_N}_(?:model|optim)_states\.pt$",
    rf"^layer_{_N}(?:-model_{_N})?-model_states\.pt$",
    rf"^(?:layer_{_N}_)?expert_{_N}_mp_rank_{_N}_model_states\.pt$",
    rf"^expp_rank_{_N}_mp_rank_{_N}_optim_states\.pt$",
)), allowed=("DeepSpeed checkpoint file names: mp_rank_NN_model_states.pt, "
             "[bf16_]zero_pp_rank_R_mp_rank_NN_{model,optim}_states.pt, layer_LL[-model_MM]-model_states.pt, "
             "[layer_L_]expert_E_mp_rank_NN_model_states.pt, expp_rank_R_mp_rank_NN_optim_states.pt"))
_names: list[Callable[[], FileNames]] = []  # process-wide: set by a framework integration at its import


def use_file_names(provider: Callable[[], FileNames]) -> None:
    """From now on, the names a base may hold are ``provider()`` (called at the first check, then cached by the
    provider). Called by a framework integration at its import; the last one wins."""
    _names[:] = [provider]


def file_names() -> FileNames:
    """The rule in force: the integration's (:func:`use_file_names`), else :data:`FALLBACK_NAMES`."""
    return _names[0]() if _names else FALLBACK_NAMES


Progress = Callable[[int, int], None]


def version_tag(version: int) -> str:
    return f"global_step{version}"


def parse_tag(name: str) -> int | None:
    m = _TAG.fullmatch(name) if isinstance(name, str) else None
    return int(m.group(1)) if m else None


def check_file_name(name: object, where: str) -> str:
    """``name`` if it is one of DeepSpeed's checkpoint file names (:func:`file_names`); else
    :class:`~deadpool_ext.persist.records.UnsafeNameError` naming ``where``."""
    return file_names().check(name, where)


def rank_manifest_name(rank: int) -> str:
    # Same prefix as persist.atomic's manifests, so DeadpoolCheckpointEngine.load() verifies files against it.
    return f"deadpool_manifest.rank{rank}.json"


@dataclass(slots=True)
class VersionInfo:
    version: int
    tag: str
    commit: dict[str, Any] | None
    """The parsed (validated, and with a key authenticated) commit record; None: none, or refused."""
    problem: str | None = None
    """Why a commit record that is present was refused (one line naming the file); None when it was not."""
    recorded: bool | None = None
    """A commit record file exists (valid or not); None: not looked at (then: ``commit is not None``)."""

    @property
    def complete(self) -> bool:
        return self.commit is not None

    @property
    def has_record(self) -> bool:
        return self.recorded if self.recorded is not None else self.commit is not None

    @property
    def nbytes(self) -> int:
        return int(self.commit["total_bytes"]) if self.commit else 0


def where(storage: Storage, rel: str) -> str:
    """``rel`` under the storage's URL, as messages name it."""
    return f"{storage.url.rstrip('/')}/{rel}"


def read_record_bytes(storage: Storage, rel: str) -> bytes | None:
    """The bytes of a small record, bounded; None when the file does not exist."""
    try:
        with storage.open_read(rel) as fh:
            return read_capped(fh, where(storage, rel))
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
        return None
    except NotRegularFileError as exc:   # a FIFO or device where a record belongs: refused, never opened
        raise BadRecordError(str(exc)) from None


def read_json(storage: Storage, rel: str) -> dict[str, Any] | None:
    """A JSON object at ``rel``; None when absent or not a JSON object (for polling: see :func:`parse_commit`
    and :func:`parse_rank_manifest` for the strict readers)."""
    try:
        data = read_record_bytes(storage, rel)
        return None if data is None else parse_json_object(data, where(storage, rel))
    except (BadRecordError, OSError):
        return None


def _layout_fields(rec: dict[str, Any], here: str) -> None:
    get_int(rec, "world_size", here, lo=1, hi=1 << 24, required=False)
    get_int(rec, "dp_world_size", here, lo=1, hi=1 << 24, required=False)
    get_int(rec, "zero_stage", here, lo=0, hi=3, required=False)
    get_int(rec, "global_steps", here, required=False)
    get_int(rec, "global_samples", here, required=False)
    get_number(rec, "published_at", here, required=False)
    get_number(rec, "write_s", here, required=False)


def parse_commit(data: bytes, tag: str, here: str, *, key: bytes | None = None) -> dict[str, Any]:
    """The commit record of base ``tag`` from its bytes, validated (and with ``key`` authenticated); raises
    :class:`~deadpool_ext.persist.records.BadRecordError` / ``UnsafeNameError`` / ``SignatureError`` naming
    ``here``. The result has the record's fields with ``files`` normalised (names checked, sizes ints)."""
    rec = parse_json_object(data, here)
    fmt = rec.get("format")
    if fmt != FORMAT:
        raise BadRecordError(f"{here}: field 'format' is {one_line(repr(fmt), 60)}, expected {FORMAT!r}")
    sign.check(rec, sign.KIND_COMMIT, key, here)
    version = parse_tag(tag)
    if version is None:
        raise BadRecordError(f"{here}: directory {one_line(repr(tag), 60)} is not {TAG_ALLOWED}")
    if get_int(rec, "version", here, required=False) not in (None, version):
        raise BadRecordError(f"{here}: field 'version' = {rec['version']} but the base is {tag}")
    if get_str(rec, "tag", here, required=False) not in (None, tag):
        raise BadRecordError(f"{here}: field 'tag' = {one_line(repr(rec['tag']), 60)} but the base is {tag}")
    files = parse_file_entries(get_object(rec, "files", here), here, lambda n: check_file_name(n, here),
                               extra=lambda e, h: {} if "rank" not in e else {"rank": get_int(e, "rank", h)})
    total = get_int(rec, "total_bytes", here)
    if total != sum(e["nbytes"] for e in files.values()):
        raise BadRecordError(f"{here}: field 'total_bytes' = {total} is not the sum of the files' nbytes "
                             f"({sum(e['nbytes'] for e in files.values())})")
    _layout_fields(rec, here)
    return {**rec, "files": files}


def parse_rank_manifest(data: bytes, here: str, *, key: bytes | None = None) -> dict[str, Any]:
    """A per-rank manifest (``deadpool_manifest.rankR.json``) from its bytes, validated like a commit record."""
    rec = parse_json_object(data, here)
    sign.check(rec, sign.KIND_RANK_MANIFEST, key, here)
    get_int(rec, "rank", here, hi=1 << 24)
    get_int(rec, "version", here)
    get_str(rec, "tag", here, pattern=_TAG, allowed=TAG_ALLOWED)
    get_number(rec, "write_s", here, required=False)
    files = parse_file_entries(get_object(rec, "files", here), here, lambda n: check_file_name(n, here))
    return {**rec, "files": files}


def read_commit(storage: Storage, tag: str, *, key: bytes | None = None) -> dict[str, Any] | None:
    """The validated commit record of ``tag``; None when there is none. A record that is present but bad
    raises (:class:`~deadpool_ext.persist.records.CheckpointTrustError`, one line naming it)."""
    if parse_tag(tag) is None:
        raise BadRecordError(f"{where(storage, '')}: {one_line(repr(tag), 60)} is not {TAG_ALLOWED}")
    rel = f"{tag}/{COMMIT}"
    data = read_record_bytes(storage, rel)
    if data is None:
        return None
    return parse_commit(data, tag, where(storage, rel), key=key)


def read_version(storage: Storage, tag: str, *, key: bytes | None = None) -> VersionInfo:
    """``tag`` with its commit record, or with the reason its record is refused (``problem``)."""
    version = parse_tag(tag)
    if version is None:
        raise BadRecordError(f"{where(storage, '')}: {one_line(repr(tag), 60)} is not {TAG_ALLOWED}")
    try:
        commit = read_commit(storage, tag, key=key)
    except CheckpointTrustError as exc:
        return VersionInfo(version, tag, None, problem=str(exc), recorded=True)
    except OSError as exc:  # a record that cannot be read is refused too, naming it
        return VersionInfo(version, tag, None, problem=f"{where(storage, f'{tag}/{COMMIT}')}: cannot be read "
                                                      f"({one_line(exc, 120)})", recorded=True)
    return VersionInfo(version, tag, commit, recorded=commit is not None)


def read_latest(storage: Storage) -> str | None:
    """The tag ``latest`` names (None: no ``latest``); anything but ``global_step<N>`` raises
    :class:`~deadpool_ext.persist.records.BadRecordError` naming the file."""
    data = read_record_bytes(storage, LATEST)
    if data is None:
        return None
    here = where(storage, LATEST)
    try:
        text = data.decode("utf-8").strip()
    except UnicodeDecodeError:
        raise BadRecordError(f"{here}: not UTF-8 text; expected {TAG_ALLOWED}") from None
    if parse_tag(text) is None:
        raise BadRecordError(f"{here}: holds {one_line(repr(text), 60)}, expected {TAG_ALLOWED}")
    return text


def list_versions(storage: Storage, *, key: bytes | None = None) -> list[VersionInfo]:
    """Every ``global_stepN`` directory, oldest first, with its commit record (None: incomplete, or refused:
    then ``problem`` says why)."""
    out = []
    for name in storage.listdir(""):
        if parse_tag(name) is not None:
            out.append(read_version(storage, name, key=key))
    return sorted(out, key=lambda i: i.version)


def load_candidates(storage: Storage, *, key: bytes | None = None,
                    refused: list[VersionInfo] | None = None) -> list[VersionInfo]:
    """Complete versions a resume may use, newest first. ``latest`` is honoured as an upper bound when it names
    a complete version: it only ever moves forward at publish, so it differs from the newest commit record
    only when a user pinned an older base on purpose (DeepSpeed's own convention) or a publish was cut between
    the commit record and ``latest`` (then the older base is equally consistent). Bases whose record is
    refused are appended to ``refused`` (for the caller to report); a malformed ``latest`` raises."""
    versions = list_versions(storage, key=key)
    for v in versions:
        if v.complete and storage.exists(f"{v.tag}/{QUARANTINE}"):
            v.commit, v.problem = None, f"{where(storage, f'{v.tag}/{QUARANTINE}')}: quarantined (numerical canary)"
    if refused is not None:
        refused.extend(v for v in versions if v.problem is not None)
    complete = [v for v in versions if v.complete]
    pin = parse_tag(read_latest(storage) or "")
    if pin is not None and any(v.version == pin for v in complete):
        complete = [v for v in complete if v.version <= pin]
    return sorted(complete, key=lambda i: -i.version)


def quarantine_base(storage: Storage, version: int, *, why: str) -> list[int]:
    """Mark the bases of ``version`` and of every newer step (trained from it) bad (:data:`QUARANTINE`, JSON); the
    steps marked."""
    marked = []
    for name in storage.listdir(""):
        v = parse_tag(name)
        if v is not None and v >= version:
            record = {"version": version, "why": why, "time": time.time()}
            storage.write_bytes(f"{name}/{QUARANTINE}", json.dumps(record).encode())
            marked.append(v)
    return sorted(marked)


def checksum_stream(chunks: Any) -> tuple[int, str]:
    h = xxhash.xxh3_64()
    n = 0
    for block in chunks:
        h.update(block)
        n += len(block)
    return n, h.hexdigest()


def _check_file(storage: Storage, rel: str, entry: dict[str, Any]) -> str | None:
    if not storage.exists(rel):
        return f"{where(storage, rel)}: listed in {COMMIT} but missing"
    size = storage.size(rel)
    if size != int(entry["nbytes"]):
        return f"{where(storage, rel)}: size {size} != {entry['nbytes']} in the manifest (truncated or corrupt file)"
    n, digest = checksum_stream(storage.iter_chunks(rel))
    if n != size or digest != entry["xxh3_64"]:
        return f"{where(storage, rel)}: checksum does not match the manifest (corrupt file)"
    return None


def verify_version(storage: Storage, info: VersionInfo, names: list[str] | None = None,
                   progress: Progress | None = None) -> list[str]:
    """Check sizes and checksums of ``names`` (default: every file of the base); return one message per bad
    file (empty: verified). Each message names the file and what is wrong. Only names listed in the (validated)
    commit record are ever opened."""
    assert info.commit is not None
    files: dict[str, dict[str, Any]] = info.commit["files"]
    todo = sorted(files) if names is None else names
    total = sum(int(files[n]["nbytes"]) for n in todo if n in files)
    done = 0
    errors = []
    for name in todo:
        entry = files.get(name)
        if entry is None:
            errors.append(f"{where(storage, info.tag)}/{one_line(name, 80)}: not listed in {COMMIT}")
            continue
        try:
            check_file_name(name, where(storage, f"{info.tag}/{COMMIT}"))
            problem = _check_file(storage, f"{info.tag}/{name}", entry)
        except CheckpointTrustError as exc:
            problem = str(exc)
        except OSError as exc:
            problem = f"{where(storage, info.tag)}/{name}: cannot be read ({one_line(exc, 120)})"
        if problem is not None:
            errors.append(problem)
            continue
        done += int(entry["nbytes"])
        if progress is not None:
            progress(done, total)
    return errors


def build_commit(version: int, rank_manifests: dict[int, dict[str, Any]], layout: dict[str, Any],
                 write_s: float, *, key: bytes | None = None) -> dict[str, Any]:
    files: dict[str, dict[str, Any]] = {}
    for rank, man in sorted(rank_manifests.items()):
        for name, entry in man["files"].items():
            files[name] = {"nbytes": entry["nbytes"], "xxh3_64": entry["xxh3_64"], "rank": rank}
    rec = {"format": FORMAT, "version": version, "tag": version_tag(version), "files": files,
           "total_bytes": sum(int(e["nbytes"]) for e in files.values()), "published_at": time.time(),
           "write_s": write_s, **layout}
    return sign.sign(rec, sign.KIND_COMMIT, key)


def collect_garbage(storage: Storage, keep_last: int, log: Callable[[str], None]) -> list[str]:
    """Delete complete bases beyond the newest ``keep_last`` and abandoned partial ones older than the newest
    complete base. Called by the coordinator only after it published *and verified* a new base, so the newest
    recoverable version is never deleted (``keep_last >= 1``). Returns the deleted tags."""
    versions = list_versions(storage)
    # A base counts as published here when its commit record exists, valid or not (a refused record is
    # never a reason to delete more than before).
    complete = [v for v in versions if v.has_record]
    if not complete:
        return []
    keep = {v.version for v in complete[-max(1, keep_last):]}
    newest = complete[-1].version
    deleted = []
    for v in versions:
        if v.version in keep:
            continue
        if v.has_record or v.version < newest:
            # Commit record first: a crash halfway through leaves an incomplete (ignored) directory, never a
            # "complete" base with files missing.
            storage.remove(f"{v.tag}/{COMMIT}")
            storage.remove_tree(v.tag)
            deleted.append(v.tag)
            log(f"tier 3: deleted {'base' if v.has_record else 'abandoned partial base'} {v.tag} "
                f"(keep_last={keep_last}, newest complete {version_tag(newest)})")
    return deleted
