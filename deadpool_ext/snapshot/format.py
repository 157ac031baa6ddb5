"""deadpool's own snapshot format: raw tensor bytes behind a JSON header (safetensors-like).

Why not ``torch.save``: snapshots cross process boundaries (shared memory, peers' RAM, disk) and are read
back by processes that must not execute code found in them, so the format is pickle-free by construction.
Python structure lives in a JSON "skeleton"; tensors live in a 64-byte aligned data section that can be
written straight into shared memory and read back as zero-copy views.

Blob layout::

    MAGIC (8) | u64 LE header length | header JSON (ASCII) | zero pad to 64 | data section

MAGIC is written last by :func:`write_blob`, so a torn write is never recognised as a blob.
"""
from __future__ import annotations

import argparse
import base64
import enum
import importlib
import json
import math
import struct
import warnings
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch
import xxhash

__all__ = [
    "MAGIC", "SnapshotFormatError", "CorruptSnapshotError", "TensorEntry", "flatten_state", "unflatten_state",
    "plan_layout", "build_header", "tensor_checksum", "bytes_checksum", "serialize", "write_blob", "blob_nbytes",
    "read_header", "deserialize", "verify_blob",
]

MAGIC = b"DPSNAP01"
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
_PLACEHOLDER = "0" * 16  # xxh3_64 hex digests are always 16 chars, so header size is known before hashing

# Enum classes are imported by name when decoding; restrict that to code we trust.
ALLOWED_ENUM_PREFIXES = ("deepspeed.", "torch.", "megatron.", "deadpool_ext.", "enum")

_DTYPE_NAMES = (
    "float32", "float64", "float16", "bfloat16", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32",
    "uint64", "bool", "complex64", "complex128", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz",
    "float8_e5m2fnuz",
)
#: dtype name <-> torch.dtype (only those this torch build has).
DTYPES: dict[str, torch.dtype] = {
    n: getattr(torch, n) for n in _DTYPE_NAMES if isinstance(getattr(torch, n, None), torch.dtype)
}
DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}

# Skeleton markers: a JSON object whose FIRST key is one of these is an encoded value, not a user dict.
_MARKERS = frozenset({
    "__t__", "__np__", "__nps__", "__tuple__", "__dict__", "__odict__", "__f__", "__bytes__", "__bytearray__",
    "__size__", "__dtype__", "__device__", "__enum__", "__ns__",
})


class SnapshotFormatError(Exception):
    """Malformed header, unsupported/unknown type, or a buffer that is not one of our blobs."""


class CorruptSnapshotError(SnapshotFormatError):
    """The blob was ours but is damaged: checksum mismatch, truncation or a torn (unfinished) write."""


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


def _fmt_path(path: tuple[Any, ...]) -> str:
    return "state" + "".join(f"[{k!r}]" for k in path)


def _enum_allowed(module: str) -> bool:
    """``"torch."`` allows ``torch`` and its submodules; ``"enum"`` allows ``enum`` and ``enum.*`` only."""
    return any(module == p.rstrip(".") or module.startswith(p.rstrip(".") + ".") for p in ALLOWED_ENUM_PREFIXES)


# --------------------------------------------------------------------------------------------- flattening
def flatten_state(obj: Any) -> tuple[object, list[torch.Tensor], list[str]]:
    """Split a nested state into a JSON-serialisable skeleton plus the tensors it references.

    Types are checked exactly (not via isinstance on builtins) so that everything that goes in comes back out
    as the same type; anything we cannot round-trip faithfully is rejected with its path rather than silently
    degraded. The same tensor object referenced twice is stored once and decodes to one shared object.
    """
    tensors: list[torch.Tensor] = []
    names: list[str] = []
    seen: dict[int, int] = {}  # id(tensor or ndarray) -> index; objects stay alive via `obj`
    active: set[int] = set()  # containers on the current recursion stack (cycle detection)

    def add(key: int, t: torch.Tensor, path: tuple[Any, ...]) -> int:
        if key not in seen:
            seen[key] = len(tensors)
            tensors.append(t)
            names.append(".".join(str(k) for k in path))
        return seen[key]

    def enc(o: Any, path: tuple[Any, ...]) -> Any:
        t = type(o)
        if o is None or t is bool or t is int or t is str:
            return o
        if t is float:
            return o if math.isfinite(o) else {"__f__": repr(o)}
        if isinstance(o, torch.Tensor):
            if o.layout != torch.strided or o.dtype not in DTYPE_NAMES or o.device.type == "meta":
                raise SnapshotFormatError(f"unsupported tensor ({o.dtype}, {o.layout}, {o.device}) "
                                          f"at {_fmt_path(path)}")
            return {"__t__": add(id(o), o, path)}
        if t is np.ndarray:
            if o.dtype.hasobject or o.dtype.fields is not None:
                raise SnapshotFormatError(f"unsupported numpy dtype {o.dtype} at {_fmt_path(path)}")
            if id(o) not in seen:  # store raw bytes; numpy dtypes need not exist in torch (e.g. '>f8', 'U5')
                raw = np.ascontiguousarray(o).reshape(-1).view(np.uint8)
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # read-only arrays: we never write through this view
                    add(id(o), torch.from_numpy(raw), path)
            return {"__np__": seen[id(o)], "dtype": o.dtype.str, "shape": list(o.shape)}
        if isinstance(o, enum.Enum):
            cls = t
            if not _enum_allowed(cls.__module__) or "<locals>" in cls.__qualname__:
                raise SnapshotFormatError(
                    f"enum type {cls.__module__}.{cls.__qualname__} at {_fmt_path(path)} is not from an allowed "
                    f"module {ALLOWED_ENUM_PREFIXES}")
            return {"__enum__": f"{cls.__module__}:{cls.__qualname__}", "v": enc(o.value, path)}
        if isinstance(o, np.generic):
            if o.dtype.hasobject:
                raise SnapshotFormatError(f"unsupported numpy scalar {t.__name__} at {_fmt_path(path)}")
            return {"__nps__": o.dtype.str, "b64": base64.b64encode(o.tobytes()).decode("ascii")}
        if t is bytes or t is bytearray:
            return {f"__{t.__name__}__": base64.b64encode(o).decode("ascii")}
        if t is torch.Size:
            return {"__size__": list(o)}
        if t is torch.dtype:
            if o not in DTYPE_NAMES:
                raise SnapshotFormatError(f"unsupported dtype {o} at {_fmt_path(path)}")
            return {"__dtype__": DTYPE_NAMES[o]}
        if t is torch.device:
            return {"__device__": str(o)}
        if t not in (list, tuple, dict, OrderedDict, argparse.Namespace):
            raise SnapshotFormatError(f"unsupported type {t.__module__}.{t.__qualname__} at {_fmt_path(path)}")
        if id(o) in active:
            raise SnapshotFormatError(f"reference cycle at {_fmt_path(path)}")
        active.add(id(o))
        try:
            if t is list:
                return [enc(v, path + (i,)) for i, v in enumerate(o)]
            if t is tuple:
                return {"__tuple__": [enc(v, path + (i,)) for i, v in enumerate(o)]}
            if t is argparse.Namespace:
                return {"__ns__": {k: enc(v, path + (k,)) for k, v in vars(o).items()}}
            if t is dict and all(type(k) is str for k in o) and next(iter(o), None) not in _MARKERS:
                return {k: enc(v, path + (k,)) for k, v in o.items()}
            tag = "__dict__" if t is dict else "__odict__"
            return {tag: [[enc(k, path + ("<key>",)), enc(v, path + (k,))] for k, v in o.items()]}
        finally:
            active.discard(id(o))

    return enc(obj, ()), tensors, names


def _resolve_enum(spec: str) -> type[enum.Enum]:
    module, _, qualname = spec.partition(":")
    if not _enum_allowed(module):
        raise SnapshotFormatError(f"enum type {module}.{qualname} is not from an allowed module "
                                  f"{ALLOWED_ENUM_PREFIXES}")
    try:
        cls: Any = importlib.import_module(module)
        for part in qualname.split("."):
            cls = getattr(cls, part)
    except (ImportError, AttributeError) as e:
        raise SnapshotFormatError(f"cannot resolve enum type {module}.{qualname}: {e}") from e
    if not (isinstance(cls, type) and issubclass(cls, enum.Enum)):
        raise SnapshotFormatError(f"{module}.{qualname} is not an Enum type")
    return cls


def unflatten_state(skeleton: Any, tensors: Sequence[torch.Tensor]) -> object:
    """Exact inverse of :func:`flatten_state`; numpy entries become arrays viewing the given tensors."""
    np_cache: dict[int, np.ndarray] = {}

    def tensor(i: Any) -> torch.Tensor:
        if type(i) is not int or not 0 <= i < len(tensors):
            raise SnapshotFormatError(f"skeleton references tensor {i!r}, only {len(tensors)} present")
        return tensors[i]

    def dec(o: Any) -> Any:
        if type(o) is list:
            return [dec(v) for v in o]
        if type(o) is not dict:
            return o
        tag = next(iter(o), None)
        if tag not in _MARKERS:
            return {k: dec(v) for k, v in o.items()}
        val = o[tag]
        if tag == "__t__":
            return tensor(val)
        if tag == "__np__":
            if val not in np_cache:
                dt = np.dtype(o["dtype"])
                if dt.hasobject:
                    raise SnapshotFormatError(f"refusing numpy object dtype {dt}")
                np_cache[val] = tensor(val).detach().cpu().numpy().view(dt).reshape(o["shape"])
            return np_cache[val]
        if tag == "__tuple__":
            return tuple(dec(v) for v in val)
        if tag == "__dict__":
            return {dec(k): dec(v) for k, v in val}
        if tag == "__odict__":
            return OrderedDict((dec(k), dec(v)) for k, v in val)
        if tag == "__f__":
            return float(val)
        if tag == "__bytes__":
            return base64.b64decode(val)
        if tag == "__bytearray__":
            return bytearray(base64.b64decode(val))
        if tag == "__size__":
            return torch.Size(val)
        if tag == "__dtype__":
            if val not in DTYPES:
                raise SnapshotFormatError(f"unknown dtype {val!r}")
            return DTYPES[val]
        if tag == "__device__":
            return torch.device(val)
        if tag == "__enum__":
            return _resolve_enum(val)(dec(o["v"]))
        if tag == "__ns__":
            return argparse.Namespace(**{k: dec(v) for k, v in val.items()})
        # "__nps__": numpy scalar from its raw bytes
        dt = np.dtype(val)
        if dt.hasobject:
            raise SnapshotFormatError(f"refusing numpy object dtype {dt}")
        return np.frombuffer(base64.b64decode(o["b64"]), dtype=dt)[0]

    try:
        return dec(skeleton)
    except SnapshotFormatError:
        raise
    except (KeyError, TypeError, ValueError, IndexError, AttributeError) as e:
        raise SnapshotFormatError(f"malformed skeleton: {type(e).__name__}: {e}") from e


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


def _digest(data: Any) -> str:
    return f"{xxhash.xxh3_64_intdigest(data):016x}"


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
    doc = {
        "format": FORMAT_NAME, "format_version": FORMAT_VERSION, "skeleton": skeleton,
        "tensors": [dict(asdict(e), shape=list(e.shape)) for e in entries], "data_nbytes": data_nbytes,
        "checksum_algo": CHECKSUM_ALGO, "checksums": list(checksums), "meta": meta or {},
    }
    try:
        return json.dumps(doc, separators=(",", ":"), allow_nan=False).encode("ascii")
    except (TypeError, ValueError) as e:
        raise SnapshotFormatError(f"header is not JSON-serialisable (check meta): {e}") from e


# ------------------------------------------------------------------------------------------------ writing
def _prepare(obj: Any, meta: dict[str, Any] | None) -> tuple[Any, list[torch.Tensor], list[TensorEntry], int, int]:
    skeleton, tensors, names = flatten_state(obj)
    entries, data_nbytes = plan_layout(tensors, names)
    header_len = len(build_header(skeleton, entries, data_nbytes, [_PLACEHOLDER] * len(entries), meta))
    return skeleton, tensors, entries, data_nbytes, header_len


def blob_nbytes(obj: Any, meta: dict[str, Any] | None = None) -> int:
    """Exact size of ``serialize(obj, meta)`` without copying tensor data (lets callers size shared memory)."""
    _, _, _, data_nbytes, header_len = _prepare(obj, meta)
    return _align(_PREFIX.size + header_len) + data_nbytes


def write_blob(buf: memoryview, obj: Any, meta: dict[str, Any] | None = None) -> int:
    """Write the blob for ``obj`` into ``buf`` (e.g. shared memory), copying each tensor's bytes once.

    Order matters for crash safety: any old MAGIC is cleared first and the new MAGIC written last, so a
    reader never accepts a half-written blob. Checksums are computed from the bytes as written to ``buf``,
    which also lets CUDA tensors go device->buf directly without a staging copy.
    """
    skeleton, tensors, entries, data_nbytes, header_len = _prepare(obj, meta)
    data_start = _align(_PREFIX.size + header_len)
    total = data_start + data_nbytes
    mv = _as_bytes_mv(buf)
    if mv.readonly:
        raise ValueError("write_blob needs a writable buffer")
    if len(mv) < total:
        raise ValueError(f"buffer too small for snapshot: need {total} bytes, have {len(mv)}")
    mv[MAGIC_SLICE] = bytes(MAGIC_LEN)  # invalidate whatever blob was there before touching anything else
    dst = torch.frombuffer(mv, dtype=torch.uint8, count=total)
    checksums: list[str] = []
    pos = _PREFIX.size + header_len
    for t, e in zip(tensors, entries):
        start = data_start + e.offset
        dst[pos:start].zero_()
        if e.nbytes:
            dst[start:start + e.nbytes].copy_(_byte_view(t))
        checksums.append(_digest(mv[start:start + e.nbytes]))
        pos = start + e.nbytes
    header = build_header(skeleton, entries, data_nbytes, checksums, meta)
    assert len(header) == header_len, "header size changed between planning and writing"
    mv[_PREFIX.size:_PREFIX.size + header_len] = header
    dst[_PREFIX.size + header_len:data_start].zero_()
    mv[HEADER_LEN_SLICE] = pack_header_len(header_len)
    mv[MAGIC_SLICE] = MAGIC
    return total


def serialize(obj: Any, meta: dict[str, Any] | None = None) -> bytes:
    """Whole blob as ``bytes``; not for the hot path (one extra copy), shares write_blob's code for parity."""
    out = bytearray(blob_nbytes(obj, meta))
    write_blob(memoryview(out), obj, meta)
    return bytes(out)


# ------------------------------------------------------------------------------------------------ reading
def _parse(buf: Any) -> tuple[dict[str, Any], memoryview, int, list[TensorEntry]]:
    """Validate prefix/header/bounds; returns (header, byte view, data start, entries)."""
    mv = _as_bytes_mv(buf)
    if len(mv) < _PREFIX.size:
        if len(mv) >= MAGIC_LEN and bytes(mv[MAGIC_SLICE]) == MAGIC:
            raise CorruptSnapshotError(f"truncated snapshot: {len(mv)} bytes, prefix needs {_PREFIX.size}")
        raise SnapshotFormatError(f"not a deadpool snapshot ({len(mv)} bytes)")
    magic, header_len = _PREFIX.unpack_from(mv, 0)
    if magic != MAGIC:
        if magic == bytes(MAGIC_LEN):  # we clear MAGIC first and write it last: zeros mean an unfinished write
            raise CorruptSnapshotError("torn snapshot write: MAGIC missing (blob never completed)")
        raise SnapshotFormatError(f"not a deadpool snapshot (magic {magic!r})")
    if _PREFIX.size + header_len > len(mv):
        raise CorruptSnapshotError(f"truncated snapshot: header needs {header_len} bytes, buffer has {len(mv)}")
    try:
        header = json.loads(bytes(mv[_PREFIX.size:_PREFIX.size + header_len]))
    except (UnicodeDecodeError, ValueError) as exc:
        raise SnapshotFormatError(f"malformed snapshot header: {exc}") from exc
    if not isinstance(header, dict) or header.get("format") != FORMAT_NAME:
        raise SnapshotFormatError("header is not a deadpool snapshot header")
    if header.get("format_version") != FORMAT_VERSION:
        raise SnapshotFormatError(f"unsupported format_version {header.get('format_version')!r}")
    if header.get("checksum_algo") != CHECKSUM_ALGO:
        raise SnapshotFormatError(f"unsupported checksum_algo {header.get('checksum_algo')!r}")
    data_start = _align(_PREFIX.size + header_len)
    try:
        data_nbytes = int(header["data_nbytes"])
        entries = [TensorEntry(str(d["name"]), str(d["dtype"]), tuple(int(s) for s in d["shape"]),
                               int(d["offset"]), int(d["nbytes"])) for d in header["tensors"]]
        if len(header["checksums"]) != len(entries) or "skeleton" not in header:
            raise ValueError("checksums/tensors mismatch or skeleton missing")
    except (KeyError, TypeError, ValueError) as exc:
        raise SnapshotFormatError(f"malformed snapshot header: {exc}") from exc
    for ent in entries:
        if ent.dtype not in DTYPES:
            raise SnapshotFormatError(f"unknown dtype {ent.dtype!r} for tensor {ent.name!r}")
        expect = math.prod(ent.shape) * DTYPES[ent.dtype].itemsize
        if ent.nbytes != expect or ent.offset < 0 or ent.offset % ALIGN or ent.offset + ent.nbytes > data_nbytes:
            raise SnapshotFormatError(f"inconsistent layout for tensor {ent.name!r}: {ent}")
    if data_start + data_nbytes > len(mv):
        raise CorruptSnapshotError(
            f"truncated snapshot: need {data_start + data_nbytes} bytes, buffer has {len(mv)}")
    return header, mv, data_start, entries


def read_header(buf: Any) -> dict[str, Any]:
    """Parse and validate the header (no data checksums); raises on foreign, malformed or truncated blobs."""
    return _parse(buf)[0]


def _verify(header: dict[str, Any], mv: memoryview, data_start: int, entries: list[TensorEntry]) -> None:
    for i, (e, want) in enumerate(zip(entries, header["checksums"])):
        got = _digest(mv[data_start + e.offset:data_start + e.offset + e.nbytes])
        if got != want:
            raise CorruptSnapshotError(f"checksum mismatch for tensor #{i} {e.name!r}: {got} != {want}")


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
