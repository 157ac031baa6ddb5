"""Reading what storage holds as data, never as instructions: strict JSON records and validated names.

Everything tier 3 reads back from storage (commit records, per-rank manifests, ``latest``, the manifests of
:mod:`deadpool_ext.persist.atomic`) may have been written by someone else. The rules, in one place:

- a record is UTF-8 JSON of bounded size (:data:`MAX_RECORD_BYTES`), a JSON *object* at the top, no duplicate
  keys, no ``NaN``/``Infinity``, no nesting deeper than Python's parser copes with; numbers that must be counts
  are ints (not bools, not floats, not strings) in ``[0, 2**63)``;
- every name read from a record is checked against the file-name patterns the writer uses *before* it is
  joined to a path: relative, a single component (no ``/`` or ``\\``), never ``.``/``..``, no NUL, bounded
  length (:func:`check_name`);
- bad input raises :class:`BadRecordError` (or :class:`UnsafeNameError`) whose message is ONE line naming the
  file and what is wrong; callers print it as is (``deadpool inspect|verify|export``) or refuse the base
  naming it (``--load``). Nothing here raises anything else on any input (``tests/security``).
"""
from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Iterable
from typing import IO, Any

MAX_RECORD_BYTES = 64 << 20
"""Largest record read (a commit record of 10,000 ranks x 3 files is ~5 MB)."""
MAX_COUNT = (1 << 63) - 1
MAX_NAME = 255
HEX64 = re.compile(r"^[0-9a-f]{16}$")


class CheckpointTrustError(Exception):
    """Something read from storage is refused. ``str(exc)`` is one line naming the file and the reason."""


class BadRecordError(CheckpointTrustError, ValueError):
    """A record (commit record, manifest, ``latest``) is not what the writer writes: malformed, truncated, a
    wrong type, a value out of range, a missing field."""


class UnsafeNameError(BadRecordError):
    """A name read from a record is not one the layout writes (it could escape the checkpoint directory)."""


class UnsafePathError(CheckpointTrustError, OSError):
    """A path under a storage root would leave it (absolute, ``..``) or passes through a symbolic link."""


def one_line(text: object, limit: int = 300) -> str:
    """``text`` as a single printable line of at most ``limit`` characters (for messages that quote input)."""
    s = " ".join(str(text).split())
    s = "".join(c if c.isprintable() else "?" for c in s)
    return s if len(s) <= limit else s[: limit - 3] + "..."


def read_capped(fh: IO[bytes], where: str, limit: int = MAX_RECORD_BYTES) -> bytes:
    """At most ``limit`` bytes of ``fh``; a larger file is refused (a record is never that big)."""
    data = fh.read(limit + 1)
    if len(data) > limit:
        raise BadRecordError(f"{where}: larger than {limit} bytes; not a record the writer writes")
    return data


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"duplicate key {one_line(repr(k), 60)}")
        out[k] = v
    return out


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not allowed")


def parse_json_object(data: bytes, where: str) -> dict[str, Any]:
    """``data`` as a JSON object, or :class:`BadRecordError` naming ``where`` and the problem."""
    if len(data) > MAX_RECORD_BYTES:
        raise BadRecordError(f"{where}: larger than {MAX_RECORD_BYTES} bytes; not a record the writer writes")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BadRecordError(f"{where}: not UTF-8 text (byte {exc.start}); expected a JSON object") from None
    try:
        obj = json.loads(text, object_pairs_hook=_no_duplicates, parse_constant=_no_constant)
    except RecursionError:
        raise BadRecordError(f"{where}: nested too deeply; expected a flat JSON object") from None
    except ValueError as exc:  # JSONDecodeError, duplicate keys, NaN, ints beyond Python's digit limit
        raise BadRecordError(f"{where}: not valid JSON ({one_line(exc, 120)})") from None
    if not isinstance(obj, dict):
        raise BadRecordError(f"{where}: the top level is a JSON {_json_type(obj)}, expected an object")
    return obj


def _json_type(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, int | float):
        return "number"
    if isinstance(v, str):
        return "string"
    if isinstance(v, list):
        return "list"
    return "object" if isinstance(v, dict) else type(v).__name__


def field(rec: dict[str, Any], key: str, where: str) -> Any:
    if key not in rec:
        raise BadRecordError(f"{where}: field {key!r} is missing")
    return rec[key]


def get_int(rec: dict[str, Any], key: str, where: str, *, lo: int = 0, hi: int = MAX_COUNT,
            required: bool = True) -> int | None:
    """``rec[key]`` as an int in ``[lo, hi]`` (a JSON integer, not a bool, float or string)."""
    if key not in rec and not required:
        return None
    v = field(rec, key, where)
    if isinstance(v, bool) or not isinstance(v, int):
        raise BadRecordError(f"{where}: field {key!r} is a {_json_type(v)} ({one_line(repr(v), 40)}), expected an "
                             f"integer in [{lo}, {hi}]")
    if not lo <= v <= hi:
        raise BadRecordError(f"{where}: field {key!r} = {one_line(v, 40)} is out of range [{lo}, {hi}]")
    return v


def get_number(rec: dict[str, Any], key: str, where: str, *, required: bool = True) -> float | None:
    """``rec[key]`` as a finite, non-negative number (timestamps, durations)."""
    if key not in rec and not required:
        return None
    v = field(rec, key, where)
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise BadRecordError(f"{where}: field {key!r} is a {_json_type(v)}, expected a number")
    try:
        f = float(v)
    except OverflowError:
        f = math.inf
    if not math.isfinite(f) or f < 0:
        raise BadRecordError(f"{where}: field {key!r} = {one_line(v, 40)} is not a finite non-negative number")
    return f


def get_str(rec: dict[str, Any], key: str, where: str, *, pattern: re.Pattern[str] | None = None,
            allowed: str = "", required: bool = True) -> str | None:
    if key not in rec and not required:
        return None
    v = field(rec, key, where)
    if not isinstance(v, str):
        raise BadRecordError(f"{where}: field {key!r} is a {_json_type(v)}, expected a string")
    if pattern is not None and not pattern.fullmatch(v):
        raise BadRecordError(f"{where}: field {key!r} = {one_line(repr(v), 80)} is not {allowed or pattern.pattern}")
    return v


def get_object(rec: dict[str, Any], key: str, where: str) -> dict[str, Any]:
    v = field(rec, key, where)
    if not isinstance(v, dict):
        raise BadRecordError(f"{where}: field {key!r} is a {_json_type(v)}, expected an object")
    return v


# -- names ----------------------------------------------------------------------------------------------------
PLAIN_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,255}$")


def is_plain_name(name: object) -> bool:
    """One path component of safe characters that is neither ``.`` nor ``..``."""
    return isinstance(name, str) and bool(PLAIN_NAME.fullmatch(name)) and name not in (".", "..")


def check_name(name: object, where: str, patterns: Iterable[re.Pattern[str]], allowed: str) -> str:
    """``name`` if it is a plain single component matching one of ``patterns``; else :class:`UnsafeNameError`
    naming ``where`` and what is allowed. Called before ``name`` is joined to any path."""
    if not isinstance(name, str):
        raise UnsafeNameError(f"{where}: a file name is a {_json_type(name)}, expected a string ({allowed})")
    shown = one_line(repr(name), 80)
    if not is_plain_name(name):
        raise UnsafeNameError(f"{where}: file name {shown} is not a plain file name (no '/', '\\', '..', "
                              f"absolute paths or control characters; allowed: {allowed})")
    if not any(p.fullmatch(name) for p in patterns):
        raise UnsafeNameError(f"{where}: file name {shown} is not one the writer writes (allowed: {allowed})")
    return name


def parse_file_entries(files: Any, where: str, check: Callable[[object], str],
                       extra: Callable[[dict[str, Any], str], dict[str, Any]] | None = None,
                       ) -> dict[str, dict[str, Any]]:
    """The ``files`` object of a record: ``{name: {"nbytes": int, "xxh3_64": 16 hex digits, ...}}``, at least one
    entry, every name passed through ``check`` first. Returns normalised entries (only the known fields)."""
    if not isinstance(files, dict):
        raise BadRecordError(f"{where}: field 'files' is a {_json_type(files)}, expected an object")
    if not files:
        raise BadRecordError(f"{where}: field 'files' is empty; a checkpoint lists at least one file")
    out: dict[str, dict[str, Any]] = {}
    for name, entry in files.items():
        check(name)
        here = f"{where}: files[{name!r}]"
        if not isinstance(entry, dict):
            raise BadRecordError(f"{here} is a {_json_type(entry)}, expected an object with nbytes and xxh3_64")
        norm: dict[str, Any] = {"nbytes": get_int(entry, "nbytes", here),
                                "xxh3_64": get_str(entry, "xxh3_64", here, pattern=HEX64,
                                                   allowed="16 lower-case hex digits")}
        if extra is not None:
            norm.update(extra(entry, here))
        out[name] = norm
    return out
