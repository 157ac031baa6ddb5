"""deadpool's own snapshot format: raw tensor bytes behind a JSON header (safetensors-like).

Why not ``torch.save``: snapshots cross process boundaries (shared memory, peers' RAM, disk) and are read
back by processes that must not execute code found in them, so the format is pickle-free by construction.
Python structure lives in a JSON "skeleton"; tensors live in a 64-byte aligned data section that can be
written straight into shared memory and read back as zero-copy views.

Blob layout::

    MAGIC (8) | u64 LE header length | header JSON (ASCII) | zero pad to 64 | data section

MAGIC is cleared first and written last by the one writer (:class:`deadpool_ext.snapshot.slots.SlotWriter`, also
behind :func:`~deadpool_ext.snapshot.slots.write_blob` / ``serialize``), so a torn write is never recognised as a
blob. This module holds the framing, the header and the reading.

Reading trusts nothing in the bytes: decoding never imports or calls anything named by a blob (enum types come
from the explicit table :data:`ENUM_TYPES`, dtypes from :data:`DTYPES`), nesting is bounded (:data:`MAX_DEPTH`),
and every malformed header, shape, dtype, offset or count raises :class:`SnapshotFormatError` (damage:
:class:`CorruptSnapshotError`), never another exception.
"""
from __future__ import annotations

import json
import math
import struct
import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
import xxhash

from .skeleton import (
    DTYPE_NAMES,
    DTYPES,
    ENUM_TYPES,
    MAX_DEPTH,
    MAX_NDIM,
    CorruptSnapshotError,
    SnapshotFormatError,
    _dims,
    _json_depth,
    _short,
    flatten_state,
    unflatten_state,
)

__all__ = [
    "MAGIC", "QUARANTINED", "SnapshotFormatError", "CorruptSnapshotError", "TensorEntry", "flatten_state",
    "unflatten_state",
    "plan_layout", "build_header", "tensor_checksum", "bytes_checksum", "read_header", "deserialize", "verify_blob",
    "StreamVerifier", "DTYPES", "DTYPE_NAMES", "ENUM_TYPES", "MAX_DEPTH", "MAX_NDIM", "MAX_HEADER_BYTES", "PLACEHOLDER",
]

MAGIC = b"DPSNAP01"
QUARANTINED = b"DPQUAR01"
"""MAGIC replaced by this: a sealed copy the numerical canary quarantined (``snapshot/quarantine.py``), never used."""
FORMAT_NAME = "deadpool-snapshot"
FORMAT_VERSION = 1
CHECKSUM_ALGO = "xxh3_64"
ALIGN = 64
_PREFIX = struct.Struct("<8sQ")  # MAGIC + header length
# The framing, defined once: every module that touches a blob's first bytes uses these (slots, replicas).
MAGIC_LEN = 8
MAGIC_SLICE = slice(0, MAGIC_LEN)
"""Bytes 0-7: MAGIC, cleared first and written last by every writer (a torn blob has zeros here)."""
HEADER_LEN_SLICE = slice(MAGIC_LEN, _PREFIX.size)
"""Bytes 8-15: the header length, u64 little-endian."""
BODY_START = MAGIC_LEN
"""A blob is shipped as its body ``[BODY_START:len]`` first, then its MAGIC."""
PREFIX_LEN = _PREFIX.size


def header_len_of(buf: Any) -> int:
    """The header length recorded in a blob's prefix (no validation: callers probe the blob first)."""
    return int(struct.unpack("<Q", bytes(buf[HEADER_LEN_SLICE]))[0])


def pack_header_len(header_len: int) -> bytes:
    return struct.pack("<Q", header_len)
PLACEHOLDER = "0" * 16
"""A checksum before it is known: xxh3_64 hex digests are always 16 characters, so a header's size is known before
its tensors are hashed."""

MAX_HEADER_BYTES = 1 << 28
"""A header longer than this (256 MiB of JSON, ~10^6 tensors) is refused before it is parsed."""


@dataclass(frozen=True, slots=True)
class TensorEntry:
    """One tensor in the data section; ``name`` is informational (dotted path in the state)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int  # relative to the data section start, multiple of ALIGN
    nbytes: int


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


# ----------------------------------------------------------------------------------------- tensors/bytes
def _byte_view(t: torch.Tensor) -> torch.Tensor:
    """Flat uint8 view of a tensor's bytes (same device); copies only if it is not plain contiguous memory."""
    t = t.detach()
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    flat = t.contiguous().reshape(-1)
    return flat if flat.dtype == torch.uint8 else flat.view(torch.uint8)


def _as_bytes_mv(buf: Any) -> memoryview:
    mv = memoryview(buf)
    return mv if mv.format == "B" and mv.ndim == 1 else mv.cast("B")


def hex_digest(value: int) -> str:
    """The 16-character hex form of an xxh3_64 digest, as headers record it."""
    return f"{value:016x}"


def _digest(data: Any) -> str:
    return hex_digest(xxhash.xxh3_64_intdigest(data))


def bytes_checksum(buf: Any) -> str:
    """xxh3_64 hex (16 chars) of a bytes-like object, hashed in place."""
    return _digest(_as_bytes_mv(buf))


def tensor_checksum(t: torch.Tensor) -> str:
    """xxh3_64 hex of the tensor's raw bytes; bit-exact for any dtype (bf16 included) since it hashes bytes."""
    u8 = _byte_view(t)
    if u8.device.type != "cpu":
        u8 = u8.cpu()
    return _digest(u8.numpy())


def plan_layout(tensors: Sequence[torch.Tensor], names: Sequence[str]) -> tuple[list[TensorEntry], int]:
    """Assign 64-byte aligned offsets; returns entries and the data-section size. Reads metadata only."""
    entries: list[TensorEntry] = []
    end = 0
    for t, name in zip(tensors, names, strict=True):
        if t.dtype not in DTYPE_NAMES:
            raise SnapshotFormatError(f"unsupported tensor dtype {t.dtype} for {name!r}")
        off = _align(end)
        nbytes = t.numel() * t.element_size()
        entries.append(TensorEntry(name, DTYPE_NAMES[t.dtype], tuple(t.shape), off, nbytes))
        end = off + nbytes
    return entries, end


def build_header(skeleton: Any, entries: Sequence[TensorEntry], data_nbytes: int, checksums: list[str],
                 meta: dict[str, Any] | None = None) -> bytes:
    """Serialise the header as compact ASCII JSON (NaN/inf are rejected: they are not JSON)."""
    if _json_depth(meta or {}, MAX_DEPTH) > MAX_DEPTH:
        raise SnapshotFormatError(f"header meta nested deeper than {MAX_DEPTH} levels")
    doc = {
        "format": FORMAT_NAME, "format_version": FORMAT_VERSION, "skeleton": skeleton,
        "tensors": [dict(asdict(e), shape=list(e.shape)) for e in entries], "data_nbytes": data_nbytes,
        "checksum_algo": CHECKSUM_ALGO, "checksums": list(checksums), "meta": meta or {},
    }
    try:
        out = json.dumps(doc, separators=(",", ":"), allow_nan=False).encode("ascii")
    except (TypeError, ValueError, RecursionError) as e:
        raise SnapshotFormatError(f"header is not JSON-serialisable (check meta): {e}") from e
    if len(out) > MAX_HEADER_BYTES:
        raise SnapshotFormatError(f"header of {len(out)} bytes is over the {MAX_HEADER_BYTES} allowed")
    return out


# ------------------------------------------------------------------------------------------------ reading
def _parse(buf: Any, *, in_transit: bool = False) -> tuple[dict[str, Any], memoryview, int, list[TensorEntry]]:
    """Validate prefix/header/bounds; returns (header, byte view, data start, entries). ``in_transit``: the blob is
    still arriving (its MAGIC comes last), so the MAGIC is not required (:class:`StreamVerifier`)."""
    mv = _as_bytes_mv(buf)
    if len(mv) < _PREFIX.size:
        if len(mv) >= MAGIC_LEN and bytes(mv[MAGIC_SLICE]) == MAGIC:
            raise CorruptSnapshotError(f"truncated snapshot: {len(mv)} bytes, prefix needs {_PREFIX.size}")
        raise SnapshotFormatError(f"not a deadpool snapshot ({len(mv)} bytes)")
    magic, header_len = _PREFIX.unpack_from(mv, 0)
    if magic != MAGIC and not in_transit:
        if magic == bytes(MAGIC_LEN):  # we clear MAGIC first and write it last: zeros mean an unfinished write
            raise CorruptSnapshotError("torn snapshot write: MAGIC missing (blob never completed)")
        raise SnapshotFormatError(f"not a deadpool snapshot (magic {magic!r})")
    if header_len > MAX_HEADER_BYTES:
        raise SnapshotFormatError(f"malformed snapshot header: length {header_len} is over the {MAX_HEADER_BYTES} "
                                  "allowed")
    if _PREFIX.size + header_len > len(mv):
        raise CorruptSnapshotError(f"truncated snapshot: header needs {header_len} bytes, buffer has {len(mv)}")
    try:
        header = json.loads(bytes(mv[_PREFIX.size:_PREFIX.size + header_len]).decode("ascii"),
                            parse_constant=_no_constant)
    except RecursionError:
        raise SnapshotFormatError(f"malformed snapshot header: nested deeper than {MAX_DEPTH} levels") from None
    except (UnicodeDecodeError, ValueError) as exc:
        raise SnapshotFormatError(f"malformed snapshot header: {type(exc).__name__}: {_short(str(exc))}") from exc
    if type(header) is not dict or header.get("format") != FORMAT_NAME:
        raise SnapshotFormatError("header is not a deadpool snapshot header")
    if header.get("format_version") != FORMAT_VERSION or type(header.get("format_version")) is not int:
        raise SnapshotFormatError(f"unsupported format_version {_short(header.get('format_version'))}")
    if header.get("checksum_algo") != CHECKSUM_ALGO:
        raise SnapshotFormatError(f"unsupported checksum_algo {_short(header.get('checksum_algo'))}")
    if _json_depth(header, MAX_DEPTH + 1) > MAX_DEPTH + 1:
        raise SnapshotFormatError(f"malformed snapshot header: nested deeper than {MAX_DEPTH} levels")
    data_start = _align(_PREFIX.size + header_len)
    data_nbytes = header.get("data_nbytes")
    tensors, checksums = header.get("tensors"), header.get("checksums")
    if type(data_nbytes) is not int or data_nbytes < 0:
        raise SnapshotFormatError(f"malformed snapshot header: data_nbytes {_short(data_nbytes)} (a non-negative "
                                  "integer is allowed)")
    if type(tensors) is not list or type(checksums) is not list or len(checksums) != len(tensors):
        raise SnapshotFormatError("malformed snapshot header: tensors and checksums must be lists of one length")
    if not all(type(c) is str and len(c) == 16 for c in checksums):
        raise SnapshotFormatError("malformed snapshot header: checksums must be 16-digit hex strings")
    if "skeleton" not in header or type(header.get("meta", {})) is not dict:
        raise SnapshotFormatError("malformed snapshot header: skeleton missing or meta not an object")
    entries = [_entry(i, d) for i, d in enumerate(tensors)]
    end = 0
    for ent in entries:
        expect = math.prod(ent.shape) * DTYPES[ent.dtype].itemsize
        if ent.nbytes != expect:
            raise SnapshotFormatError(f"inconsistent layout for tensor {ent.name!r}: {ent.nbytes} bytes, its shape "
                                      f"and dtype make {expect}")
        if ent.offset % ALIGN or ent.offset < end or ent.offset + ent.nbytes > data_nbytes:
            raise SnapshotFormatError(
                f"inconsistent layout for tensor {ent.name!r}: offset {ent.offset} (allowed: a multiple of {ALIGN}, "
                f"after the previous tensor's end {end}, ending within the data section of {data_nbytes} bytes)")
        end = ent.offset + ent.nbytes
    if data_start + data_nbytes > len(mv):
        raise CorruptSnapshotError(
            f"truncated snapshot: need {data_start + data_nbytes} bytes, buffer has {len(mv)}")
    return header, mv, data_start, entries


def _no_constant(name: str) -> None:
    raise ValueError(f"{name} is not JSON")


_ENTRY_KEYS = frozenset({"name", "dtype", "shape", "offset", "nbytes"})


def _entry(i: int, d: Any) -> TensorEntry:
    """Tensor entry #i of a header, every field checked (types are exact: no int from a float, bool or str)."""
    if type(d) is not dict or d.keys() != _ENTRY_KEYS:
        raise SnapshotFormatError(f"malformed snapshot header: tensor #{i} must be an object with keys "
                                  f"{sorted(_ENTRY_KEYS)}")
    name, dtype, offset, nbytes = d["name"], d["dtype"], d["offset"], d["nbytes"]
    if type(name) is not str:
        raise SnapshotFormatError(f"malformed snapshot header: tensor #{i} name {_short(name)} is not a string")
    if type(dtype) is not str or dtype not in DTYPES:
        raise SnapshotFormatError(f"unknown dtype {_short(dtype)} for tensor {name!r} (allowed: {sorted(DTYPES)})")
    for key, value in (("offset", offset), ("nbytes", nbytes)):
        if type(value) is not int or value < 0:
            raise SnapshotFormatError(f"inconsistent layout for tensor {name!r}: {key} {_short(value)} (a "
                                      "non-negative integer is allowed)")
    return TensorEntry(name, dtype, _dims(d["shape"], f"tensor {name!r}"), offset, nbytes)


def read_header(buf: Any) -> dict[str, Any]:
    """Parse and validate the header (no data checksums); raises on foreign, malformed or truncated blobs."""
    return _parse(buf)[0]


def _verify(header: dict[str, Any], mv: memoryview, data_start: int, entries: list[TensorEntry]) -> None:
    for i, (e, want) in enumerate(zip(entries, header["checksums"])):
        got = _digest(mv[data_start + e.offset:data_start + e.offset + e.nbytes])
        if got != want:
            raise _mismatch(i, e.name, got, want)


def _mismatch(i: int, name: str, got: str, want: str) -> CorruptSnapshotError:
    """The one wording of a tensor whose bytes do not hash to its recorded checksum (after or during arrival)."""
    return CorruptSnapshotError(f"checksum mismatch for tensor #{i} {name!r}: {got} != {want}")


class StreamVerifier:
    """Checks a blob's tensor checksums while it arrives, so the check overlaps the transfer (a replica fetched
    from a peer at a restore).

    Call order: ``StreamVerifier(buf)`` on the receiving buffer; ``advance(n)`` each time bytes ``[0, n)`` of it
    are final (any order of growing ``n``; the transport calls it after each message); ``finish()`` once the whole
    blob is in. The header is parsed as soon as its last byte is in (the MAGIC, written last, is not required);
    every tensor's bytes are hashed as far as they have arrived (xxh3 streamed: the same digest as one pass), so at
    ``finish`` only the last message's bytes are left to hash. The header bytes are compared again at ``finish``:
    what was checked is what the buffer holds. ``finish`` returns ``None`` when every checksum matched, else the
    reason (the words :func:`verify_blob` raises with); the caller still probes the complete blob (MAGIC, header,
    decodability) with ``verify=False``."""

    def __init__(self, buf: Any) -> None:
        self.mv = _as_bytes_mv(buf)
        self.upto = 0
        self.problem: str | None = None
        self.hashed_early = 0
        """Bytes hashed before ``finish`` (while the rest was still arriving)."""
        self._header: bytes | None = None
        self._want: list[str] = []
        self._spans: list[tuple[int, int, str]] = []  # (start, end, name) of each tensor in the buffer
        self._next = 0
        self._at = 0  # bytes of tensor ``_next`` hashed so far
        self._hash = xxhash.xxh3_64()

    def advance(self, upto: int, *, final: bool = False) -> None:
        self.upto = max(self.upto, min(upto, len(self.mv)))
        if self.problem is not None:
            return
        try:
            if self._header is None and not self._parse_header():
                return
            while self._next < len(self._spans):
                start, end, name = self._spans[self._next]
                stop = min(end, self.upto)
                if stop > start + self._at:
                    self._hash.update(self.mv[start + self._at:stop])
                    self.hashed_early += 0 if final else stop - start - self._at
                    self._at = stop - start
                if start + self._at < end:
                    return
                got = hex_digest(self._hash.intdigest())
                if got != self._want[self._next]:
                    raise _mismatch(self._next, name, got, self._want[self._next])
                self._next, self._at = self._next + 1, 0
                self._hash.reset()
        except SnapshotFormatError as exc:
            self.problem = str(exc)

    def _parse_header(self) -> bool:
        if self.upto < _PREFIX.size:
            return False
        header_len = _PREFIX.unpack_from(self.mv, 0)[1]
        if header_len <= MAX_HEADER_BYTES and self.upto < _PREFIX.size + header_len:
            return False  # an over-long length is refused by _parse at once
        header, _, data_start, entries = _parse(self.mv, in_transit=True)
        self._header = bytes(self.mv[MAGIC_LEN:_PREFIX.size + header_len])
        self._want = list(header["checksums"])
        self._spans = [(data_start + e.offset, data_start + e.offset + e.nbytes, e.name) for e in entries]
        return True

    def finish(self) -> str | None:
        self.advance(len(self.mv), final=True)
        if self.problem is None and self._header is None:
            self.problem = f"not a deadpool snapshot ({len(self.mv)} bytes: its header never arrived)"
        if self.problem is None and bytes(self.mv[MAGIC_LEN:MAGIC_LEN + len(self._header or b"")]) != self._header:
            self.problem = "the header changed after its checksums were checked"
        return self.problem


def verify_blob(buf: Any) -> None:
    """Check every tensor checksum; raises CorruptSnapshotError on the first mismatch."""
    _verify(*_parse(buf))


def deserialize(buf: Any, *, verify: bool = True, copy: bool = True) -> tuple[Any, dict[str, Any]]:
    """Decode a blob into ``(obj, meta)``.

    With ``verify`` all checksums pass before any object is built, so callers never see partially-corrupt
    state. ``copy=False`` returns tensors viewing ``buf`` (caller must keep it alive and, for read-only
    buffers such as ``bytes``, must not write to them); ``copy=True`` returns tensors owning their memory.
    """
    header, mv, data_start, entries = _parse(buf)
    if verify:
        _verify(header, mv, data_start, entries)
    tensors: list[torch.Tensor] = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch warns on read-only buffers; copy=False documents the contract
        for e in entries:
            dtype = DTYPES[e.dtype]
            if e.nbytes == 0:  # torch.frombuffer rejects empty ranges
                tensors.append(torch.empty(e.shape, dtype=dtype))
                continue
            t = torch.frombuffer(mv, dtype=torch.uint8, count=e.nbytes, offset=data_start + e.offset)
            t = t.view(dtype).reshape(e.shape)
            tensors.append(t.clone() if copy else t)
    meta = header.get("meta") or {}
    return unflatten_state(header["skeleton"], tensors), meta
