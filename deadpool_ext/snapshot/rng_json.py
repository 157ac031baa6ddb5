"""The RNG state of `snapshot.state.capture_rng` as plain JSON, exactly, so it can cross ranks without pickle.

``capture_rng()`` holds python's ``random.getstate()`` (a tuple of ints and an optional float), numpy's
``get_state()`` (a name, a uint32 array, ints and a float) and torch's generator states (uint8 tensors).
`rng_to_json` maps them onto JSON values without loss (ints stay ints, the float is written with ``repr``
precision by ``json``, byte tensors go base64), `rng_from_json` checks every field of what a peer sent and
rebuilds the same objects, so restoring a round-tripped state draws the very same numbers (the losses of a
resumed run stay bit-identical). Anything malformed raises `RngStateError` naming the field.

`gather_rng_states()` is the collective that replaced ``dist.all_gather_object(capture_rng())`` in the
pretraining scripts' tier-3 client state (training/pretrain.py).
"""
from __future__ import annotations

import base64
import binascii
import math
from typing import Any

import numpy as np
import torch

from ..cluster.comm import CommError, allgather_json
from .state import capture_rng

__all__ = ["RngStateError", "rng_to_json", "rng_from_json", "gather_rng_states"]

_MT_WORDS = 624            # Mersenne Twister state words (python and numpy)
_MAX_GENERATOR_BYTES = 1 << 20
_KEYS = {"python", "numpy", "torch", "cuda"}


class RngStateError(ValueError):
    """An RNG state read from a peer or a record is malformed (the message names the field)."""


def _bytes_of(t: torch.Tensor, what: str) -> str:
    if t.dtype != torch.uint8 or t.dim() != 1:
        raise RngStateError(f"{what} must be a 1-D uint8 tensor, got {t.dtype} of shape {tuple(t.shape)}")
    return base64.b64encode(t.cpu().contiguous().numpy().tobytes()).decode("ascii")


def rng_to_json(state: dict[str, Any]) -> dict[str, Any]:
    """`capture_rng()`'s dict -> a JSON-able dict (lists, ints, floats, str)."""
    version, words, gauss = state["python"]
    name, keys, pos, has_gauss, cached = state["numpy"]
    out: dict[str, Any] = {
        "python": {"version": int(version), "state": [int(w) for w in words],
                   "gauss": None if gauss is None else float(gauss)},
        "numpy": {"name": str(name), "keys": [int(k) for k in np.asarray(keys, dtype=np.uint32)],
                  "pos": int(pos), "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
        "torch": _bytes_of(state["torch"], "torch RNG state"),
    }
    if "cuda" in state:
        out["cuda"] = [_bytes_of(t, f"cuda RNG state {i}") for i, t in enumerate(state["cuda"])]
    return out


def _field(obj: dict[str, Any], key: str, where: str) -> Any:
    if key not in obj:
        raise RngStateError(f"{where}: missing field {key!r}")
    return obj[key]


def _int(v: Any, where: str, lo: int, hi: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise RngStateError(f"{where} must be an int in {lo}..{hi}, got {str(v)[:40]!r}")
    return v


def _float(v: Any, where: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise RngStateError(f"{where} must be a number, got {str(v)[:40]!r}")
    try:
        f = float(v)
    except OverflowError:
        raise RngStateError(f"{where} is out of the float range") from None
    if not math.isfinite(f):
        raise RngStateError(f"{where} must be finite, got {f}")
    return f


def _words(v: Any, where: str, n: int) -> list[int]:
    if not isinstance(v, list) or len(v) != n:
        raise RngStateError(f"{where} must be a list of {n} ints, got "
                            f"{type(v).__name__}{f' of {len(v)}' if isinstance(v, list) else ''}")
    return [_int(w, f"{where}[{i}]", 0, 0xFFFFFFFF) for i, w in enumerate(v)]


def _generator(v: Any, where: str) -> torch.Tensor:
    if not isinstance(v, str) or len(v) > _MAX_GENERATOR_BYTES * 4 // 3 + 4:
        raise RngStateError(f"{where} must be a base64 string of at most {_MAX_GENERATOR_BYTES} bytes")
    try:
        raw = base64.b64decode(v, validate=True)
    except (binascii.Error, ValueError):
        raise RngStateError(f"{where} is not valid base64") from None
    if not raw:
        raise RngStateError(f"{where} is empty")
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).clone()


def rng_from_json(obj: Any, where: str = "RNG state") -> dict[str, Any]:
    """The inverse of `rng_to_json`, checking everything: the dict `restore_rng` takes."""
    if not isinstance(obj, dict):
        raise RngStateError(f"{where} must be a JSON object, got {type(obj).__name__}")
    unknown = set(obj) - _KEYS
    if unknown:
        raise RngStateError(f"{where}: unknown fields {sorted(map(str, unknown))[:5]}; allowed {sorted(_KEYS)}")
    py = _field(obj, "python", where)
    if not isinstance(py, dict):
        raise RngStateError(f"{where}.python must be an object")
    words = py.get("state")
    if not isinstance(words, list) or len(words) != _MT_WORDS + 1:
        raise RngStateError(f"{where}.python.state must be a list of {_MT_WORDS + 1} ints")
    state = _words(words[:_MT_WORDS], f"{where}.python.state", _MT_WORDS)
    index = _int(words[_MT_WORDS], f"{where}.python.state[{_MT_WORDS}]", 0, _MT_WORDS)
    gauss = _field(py, "gauss", f"{where}.python")
    python = (_int(_field(py, "version", f"{where}.python"), f"{where}.python.version", 3, 3),
              (*state, index), None if gauss is None else _float(gauss, f"{where}.python.gauss"))
    npy = _field(obj, "numpy", where)
    if not isinstance(npy, dict):
        raise RngStateError(f"{where}.numpy must be an object")
    if _field(npy, "name", f"{where}.numpy") != "MT19937":
        raise RngStateError(f"{where}.numpy.name must be 'MT19937'")
    numpy = ("MT19937",
             np.array(_words(_field(npy, "keys", f"{where}.numpy"), f"{where}.numpy.keys", _MT_WORDS), dtype=np.uint32),
             _int(_field(npy, "pos", f"{where}.numpy"), f"{where}.numpy.pos", 0, _MT_WORDS),
             _int(_field(npy, "has_gauss", f"{where}.numpy"), f"{where}.numpy.has_gauss", 0, 1),
             _float(_field(npy, "cached_gaussian", f"{where}.numpy"), f"{where}.numpy.cached_gaussian"))
    out: dict[str, Any] = {"python": python, "numpy": numpy,
                           "torch": _generator(_field(obj, "torch", where), f"{where}.torch")}
    if "cuda" in obj:
        cuda = obj["cuda"]
        if not isinstance(cuda, list) or len(cuda) > 1024:
            raise RngStateError(f"{where}.cuda must be a list of at most 1024 base64 strings")
        out["cuda"] = [_generator(c, f"{where}.cuda[{i}]") for i, c in enumerate(cuda)]
    return out


def gather_rng_states(group: Any = None) -> dict[str, dict[str, Any]]:
    """Collective: every rank's `capture_rng()` as {str(rank): state}, over JSON (never unpickled).

    Raises `RngStateError` (a `ValueError`) on every rank if any rank sent something malformed.
    """
    try:
        gathered = allgather_json(rng_to_json(capture_rng()), group=group)
    except CommError as exc:
        raise RngStateError(f"gathering the ranks' RNG states: {exc}") from None
    return {str(r): rng_from_json(s, f"rank {r}'s RNG state") for r, s in enumerate(gathered)}
