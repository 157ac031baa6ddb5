"""The skeleton codec of the snapshot format: a state's Python structure <-> JSON, tensors by reference.

:func:`flatten_state` splits a nested state into a JSON-serialisable skeleton plus the tensors it references;
:func:`unflatten_state` is its exact inverse. Decoding trusts nothing in the skeleton: it never imports or calls
anything a skeleton names (enum types come from the explicit table :data:`ENUM_TYPES`, dtypes from
:data:`DTYPES`), nesting is bounded by :data:`MAX_DEPTH` on both sides, and anything malformed raises
:class:`SnapshotFormatError`. :mod:`.format` (the blob) re-exports what it needs; import from there.
"""
from __future__ import annotations

import argparse
import base64
import enum
import math
import re
import sys
import warnings
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

__all__ = ["DTYPES", "DTYPE_NAMES", "ENUM_TYPES", "MAX_DEPTH", "MAX_NDIM", "SnapshotFormatError",
           "CorruptSnapshotError", "flatten_state", "unflatten_state"]

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
