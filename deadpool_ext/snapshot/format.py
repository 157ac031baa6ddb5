"""deadpool's own snapshot format: raw tensor bytes behind a JSON header (safetensors-like).

Why not ``torch.save``: snapshots cross process boundaries (shared memory, peers' RAM, disk) and are read
back by processes that must not execute code found in them, so the format is pickle-free by construction.
Python structure lives in a JSON "skeleton"; tensors live in a 64-byte aligned data section that can be
written straight into shared memory and read back as zero-copy views.

Blob layout::

    MAGIC (8) | u64 LE header length | header JSON (ASCII) | zero pad to 64 | data section

MAGIC is written last by :func:`write_blob`, so a torn write is never recognised as a blob.

Reading trusts nothing in the bytes: decoding never imports or calls anything named by a blob (enum types come
from the explicit table :data:`ENUM_TYPES`, dtypes from :data:`DTYPES`), nesting is bounded (:data:`MAX_DEPTH`),
and every malformed header, shape, dtype, offset or count raises :class:`SnapshotFormatError` (damage:
:class:`CorruptSnapshotError`), never another exception.
"""
from __future__ import annotations

import argparse
import base64
import enum
import json
import math
import re
import struct
import sys
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

ENUM_TYPES: frozenset[str] = frozenset({
    "deepspeed.runtime.zero.config:ZeroStageEnum",
})
"""The only enum types a snapshot may hold, as ``module:qualname``. Decoding looks a name up here and takes the
class from its module only if this process has already imported that module (the framework that wrote the
value is loaded where it is restored): nothing is ever imported because a blob names it. Adapters' states hold
no other enum today; a new one is added here, by name, deliberately."""

MAX_DEPTH = 64
"""Deepest nesting of JSON containers in a skeleton (and in header meta); deeper is refused on both sides."""
MAX_NDIM = 64
MAX_HEADER_BYTES = 1 << 28
"""A header longer than this (256 MiB of JSON, ~10^6 tensors) is refused before it is parsed."""
_MAX_ELEMENTS = 1 << 62  # product of a shape's dimensions (zeros counted as 1): torch's stride arithmetic fits
_NP_DTYPE_RE = re.compile(r"[<>|=][biufcmMSUV][0-9]{1,6}(\[[0-9]{0,6}[A-Za-z]{1,2}\])?")

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


def _enum_spec(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def _json_depth(value: Any, limit: int) -> int:
    """Nesting depth of JSON containers in ``value`` (a scalar is 0), counted without recursion; stops early
    and returns ``limit + 1`` once it exceeds ``limit``."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        v, level = stack.pop()
        if type(v) is dict:
            children: Any = v.values()
        elif type(v) is list:
            children = v
        else:
            continue
        if level > limit:
            return limit + 1
        deepest = max(deepest, level)
        stack.extend((c, level + 1) for c in children if type(c) is dict or type(c) is list)
    return deepest


def _dims(value: Any, what: str) -> tuple[int, ...]:
    """A shape: a list of at most MAX_NDIM non-negative ints whose product (zeros as 1) stays addressable."""
    if type(value) is not list or len(value) > MAX_NDIM or not all(type(d) is int and d >= 0 for d in value):
        raise SnapshotFormatError(f"{what}: shape must be a list of at most {MAX_NDIM} non-negative integers, "
                                  f"got {_short(value)}")
    if math.prod(max(d, 1) for d in value) > _MAX_ELEMENTS:
        raise SnapshotFormatError(f"{what}: shape {_short(value)} is too large (over 2**62 elements)")
    return tuple(value)


def _plain_np_dtype(dt: np.dtype[Any]) -> bool:
    """No objects, no fields or subarrays, a size, and a dtype string the decoder accepts."""
    return (not dt.hasobject and dt.fields is None and dt.subdtype is None and dt.itemsize > 0
            and _NP_DTYPE_RE.fullmatch(dt.str) is not None)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


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

    def deep(level: int, path: tuple[Any, ...]) -> None:
        if level > MAX_DEPTH:
            raise SnapshotFormatError(f"state nested deeper than {MAX_DEPTH} levels at {_fmt_path(path)[:200]}")

    def enc(o: Any, path: tuple[Any, ...], level: int = 1) -> Any:
        """``level``: the JSON nesting level the encoded value sits at (the root is 1)."""
        t = type(o)
        if o is None or t is bool or t is int or t is str:
            return o
        if t is float and math.isfinite(o):
            return o
        deep(level, path)  # everything below is encoded as a JSON container at this level
        if t is float:
            return {"__f__": repr(o)}
        if isinstance(o, torch.Tensor):
            if o.layout != torch.strided or o.dtype not in DTYPE_NAMES or o.device.type == "meta":
                raise SnapshotFormatError(f"unsupported tensor ({o.dtype}, {o.layout}, {o.device}) "
                                          f"at {_fmt_path(path)}")
            return {"__t__": add(id(o), o, path)}
        if t is np.ndarray:
            if not _plain_np_dtype(o.dtype):
                raise SnapshotFormatError(f"unsupported numpy dtype {o.dtype} at {_fmt_path(path)}")
            if id(o) not in seen:  # store raw bytes; numpy dtypes need not exist in torch (e.g. '>f8', 'U5')
                raw = np.ascontiguousarray(o).reshape(-1).view(np.uint8)
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # read-only arrays: we never write through this view
                    add(id(o), torch.from_numpy(raw), path)
            deep(level + 1, path)
            return {"__np__": seen[id(o)], "dtype": o.dtype.str, "shape": list(o.shape)}
        if isinstance(o, enum.Enum):
            if _enum_spec(t) not in ENUM_TYPES:
                raise SnapshotFormatError(
                    f"enum type {t.__module__}.{t.__qualname__} at {_fmt_path(path)} is not one a snapshot may hold "
                    f"(not from an allowed list, format.ENUM_TYPES: {sorted(ENUM_TYPES)})")
            return {"__enum__": _enum_spec(t), "v": enc(o.value, path, level + 1)}
        if isinstance(o, np.generic):
            if not _plain_np_dtype(o.dtype):
                raise SnapshotFormatError(f"unsupported numpy scalar {t.__name__} at {_fmt_path(path)}")
            return {"__nps__": o.dtype.str, "b64": base64.b64encode(o.tobytes()).decode("ascii")}
        if t is bytes or t is bytearray:
            return {f"__{t.__name__}__": base64.b64encode(o).decode("ascii")}
        if t is torch.Size:
            deep(level + 1, path)
            if not all(d >= 0 for d in o):
                raise SnapshotFormatError(f"torch.Size with a negative dimension at {_fmt_path(path)}")
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
                return [enc(v, path + (i,), level + 1) for i, v in enumerate(o)]
            if t is tuple:
                deep(level + 1, path)
                return {"__tuple__": [enc(v, path + (i,), level + 2) for i, v in enumerate(o)]}
            if t is argparse.Namespace:
                deep(level + 1, path)
                return {"__ns__": {k: enc(v, path + (k,), level + 2) for k, v in vars(o).items()}}
            if t is dict and all(type(k) is str for k in o) and next(iter(o), None) not in _MARKERS:
                return {k: enc(v, path + (k,), level + 1) for k, v in o.items()}
            tag = "__dict__" if t is dict else "__odict__"
            deep(level + 2, path)
            return {tag: [[enc(k, path + ("<key>",), level + 3), enc(v, path + (k,), level + 3)]
                          for k, v in o.items()]}
        finally:
            active.discard(id(o))

    return enc(obj, ()), tensors, names


def _resolve_enum(spec: Any) -> type[enum.Enum]:
    """The enum class named ``spec`` in :data:`ENUM_TYPES`, from its already-imported module; never imports."""
    if type(spec) is not str or spec not in ENUM_TYPES:
        raise SnapshotFormatError(f"enum type {_short(spec)} is not an Enum type a snapshot may hold (not from an "
                                  f"allowed list, format.ENUM_TYPES: {sorted(ENUM_TYPES)}; decoding imports nothing)")
    module, _, qualname = spec.partition(":")
    cls: Any = sys.modules.get(module)
    if cls is None:
        raise SnapshotFormatError(f"enum type {spec}: module {module} is not loaded in this process (decoding "
                                  "never imports; the framework that wrote it must be imported first)")
    for part in qualname.split("."):
        cls = getattr(cls, part, None)
    if not (isinstance(cls, type) and issubclass(cls, enum.Enum) and _enum_spec(cls) == spec):
        raise SnapshotFormatError(f"{spec} is not an Enum type in its loaded module")
    return cls


# Each marker's object has exactly these keys (the encoder writes no others).
_MARKER_KEYS = {tag: frozenset({tag}) for tag in _MARKERS} | {
    "__np__": frozenset({"__np__", "dtype", "shape"}), "__nps__": frozenset({"__nps__", "b64"}),
    "__enum__": frozenset({"__enum__", "v"}),
}
_NONFINITE = {"inf": math.inf, "-inf": -math.inf, "nan": math.nan}


def _np_dtype(value: Any) -> np.dtype[Any]:
    if type(value) is not str or not _NP_DTYPE_RE.fullmatch(value):
        raise SnapshotFormatError(f"numpy dtype {_short(value)} is not a plain numpy dtype string (e.g. '<f8')")
    dt = np.dtype(value)
    if not _plain_np_dtype(dt):
        raise SnapshotFormatError(f"refusing numpy dtype {dt}")
    return dt


def _b64(value: Any) -> bytes:
    if type(value) is not str:
        raise SnapshotFormatError(f"expected base64 text, got {_short(value)}")
    return base64.b64decode(value, validate=True)


def unflatten_state(skeleton: Any, tensors: Sequence[torch.Tensor]) -> object:
    """Exact inverse of :func:`flatten_state`; numpy entries become arrays viewing the given tensors. Anything
    malformed (an unknown marker layout, a bad index, type or shape, nesting beyond :data:`MAX_DEPTH`) raises
    :class:`SnapshotFormatError`; nothing named in the skeleton is imported or called."""
    if _json_depth(skeleton, MAX_DEPTH) > MAX_DEPTH:
        raise SnapshotFormatError(f"malformed skeleton: nested deeper than {MAX_DEPTH} levels")
    np_cache: dict[int, np.ndarray] = {}

    def tensor(i: Any) -> torch.Tensor:
        if type(i) is not int or not 0 <= i < len(tensors):
            raise SnapshotFormatError(f"skeleton references tensor {_short(i)}, only {len(tensors)} present")
        return tensors[i]

    def pairs(val: Any, tag: str) -> list[list[Any]]:
        if type(val) is not list or not all(type(p) is list and len(p) == 2 for p in val):
            raise SnapshotFormatError(f"malformed skeleton: {tag} must hold [key, value] pairs")
        return val

    def dec(o: Any) -> Any:
        if type(o) is list:
            return [dec(v) for v in o]
        if type(o) is not dict:
            return o
        tag = next(iter(o), None)
        if tag not in _MARKERS:
            return {k: dec(v) for k, v in o.items()}
        if o.keys() != _MARKER_KEYS[tag]:
            raise SnapshotFormatError(f"malformed skeleton: {tag} object with keys {_short(sorted(o))}")
        val = o[tag]
        if tag == "__t__":
            return tensor(val)
        if tag == "__np__":
            t = tensor(val)
            if val not in np_cache:
                dt = _np_dtype(o["dtype"])
                shape = _dims(o["shape"], "numpy array")
                if t.dtype != torch.uint8 or t.dim() != 1:
                    raise SnapshotFormatError(f"numpy array over tensor #{val}, which is not raw bytes")
                np_cache[val] = t.detach().cpu().numpy().view(dt).reshape(shape)
            return np_cache[val]
        if tag == "__tuple__":
            if type(val) is not list:
                raise SnapshotFormatError("malformed skeleton: __tuple__ must hold a list")
            return tuple(dec(v) for v in val)
        if tag == "__dict__":
            return {dec(k): dec(v) for k, v in pairs(val, tag)}
        if tag == "__odict__":
            return OrderedDict((dec(k), dec(v)) for k, v in pairs(val, tag))
        if tag == "__f__":
            if type(val) is not str or val not in _NONFINITE:
                raise SnapshotFormatError(f"malformed skeleton: __f__ {_short(val)} (allowed: {sorted(_NONFINITE)})")
            return _NONFINITE[val]
        if tag == "__bytes__":
            return _b64(val)
        if tag == "__bytearray__":
            return bytearray(_b64(val))
        if tag == "__size__":
            return torch.Size(_dims(val, "torch.Size"))
        if tag == "__dtype__":
            if type(val) is not str or val not in DTYPES:
                raise SnapshotFormatError(f"unknown dtype {_short(val)}")
            return DTYPES[val]
        if tag == "__device__":
            if type(val) is not str or len(val) > 64:
                raise SnapshotFormatError(f"malformed device {_short(val)}")
            return torch.device(val)
        if tag == "__enum__":
            return _resolve_enum(val)(dec(o["v"]))
        if tag == "__ns__":
            if type(val) is not dict:
                raise SnapshotFormatError("malformed skeleton: __ns__ must hold an object")
            return argparse.Namespace(**{k: dec(v) for k, v in val.items()})
        # "__nps__": numpy scalar from its raw bytes
        dt = _np_dtype(val)
        raw = _b64(o["b64"])
        if len(raw) != dt.itemsize:
            raise SnapshotFormatError(f"numpy scalar of {dt} needs {dt.itemsize} bytes, got {len(raw)}")
        return np.frombuffer(raw, dtype=dt)[0]

    try:
        return dec(skeleton)
    except SnapshotFormatError:
        raise
    except (KeyError, TypeError, ValueError, IndexError, AttributeError, OverflowError, RuntimeError) as e:
        # RuntimeError: torch's own refusals (a device string it does not know, ...); never a recursion, the
        # depth is checked above.
        raise SnapshotFormatError(f"malformed skeleton: {type(e).__name__}: {_short(str(e))}") from e


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
    if header_len > MAX_HEADER_BYTES:
        raise SnapshotFormatError(f"malformed snapshot header: length {header_len} is over the {MAX_HEADER_BYTES} "
                                  "allowed")
    if _PREFIX.size + header_len > len(mv):
        raise CorruptSnapshotError(f"truncated snapshot: header needs {header_len} bytes, buffer has {len(mv)}")
    try:
        header = json.loads(bytes(mv[_PREFIX.size:_PREFIX.size + header_len]).decode("ascii"),
                            parse_constant=_no_constant)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
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
