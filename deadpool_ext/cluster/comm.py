"""Small collectives over torch.distributed that carry JSON, not pickle.

``all_gather_object`` / ``broadcast_object_list`` unpickle what peers send, so a peer (or anything that can
inject into the unauthenticated gloo/NCCL connections) could make every rank execute code. Control
messages here are UTF-8 JSON in uint8 tensors: the worst a bad message can do is fail to decode, which
raises `CommError` naming the rank it came from. Sizes are exchanged first and bounded by
`MAX_MESSAGE_BYTES`, so an absurd announced length is refused before anything is allocated.

Each function is a collective: every rank of `group` calls it, in the same order.
"""
from __future__ import annotations

import json
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["MAX_MESSAGE_BYTES", "CommError", "encode_message", "decode_message", "allgather_json", "broadcast_json"]

MAX_MESSAGE_BYTES = 64 << 20   # control messages are small; a snapshot's bytes travel by the Transport


class CommError(ValueError):
    """A JSON control message from a peer was malformed or too large (the message names the rank)."""


def encode_message(obj: Any) -> bytes:
    """`obj` as the UTF-8 JSON a collective here sends; `CommError` if it is not JSON-able or too large."""
    try:
        data = json.dumps(obj, separators=(",", ":"), allow_nan=True).encode()
    except (TypeError, ValueError, RecursionError) as exc:
        raise CommError(f"control message is not JSON-able: {type(exc).__name__}: {str(exc)[:200]}") from None
    if len(data) > MAX_MESSAGE_BYTES:
        raise CommError(f"control message of {len(data)} bytes exceeds the limit of {MAX_MESSAGE_BYTES}")
    return data


def decode_message(data: bytes, sender: str) -> Any:
    """The JSON value in `data` (sent by `sender`, e.g. "rank 3"); `CommError` and nothing else otherwise."""
    try:
        return json.loads(data.decode())
    except UnicodeDecodeError:
        raise CommError(f"{sender} sent a control message that is not UTF-8") from None
    except RecursionError:
        raise CommError(f"{sender} sent a control message nested too deeply") from None
    except ValueError as exc:   # JSONDecodeError, or an integer longer than Python parses
        raise CommError(f"{sender} sent a control message that is not JSON: {str(exc)[:200]}") from None


_UNENCODABLE = -1   # announced by a rank whose own message failed to encode, so nobody waits for its bytes


def _checked_size(n: int, sender: str) -> int:
    if n == _UNENCODABLE:
        raise CommError(f"{sender} could not encode its control message (see its log)")
    if not 0 <= n <= MAX_MESSAGE_BYTES:
        raise CommError(f"{sender} announced a control message of {n} bytes; allowed 0..{MAX_MESSAGE_BYTES}")
    return n


def _as_tensor(data: bytes, length: int) -> torch.Tensor:
    t = torch.zeros(length, dtype=torch.uint8)
    if data:
        t[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return t


def _try_encode(obj: Any) -> tuple[bytes, CommError | None]:
    try:
        return encode_message(obj), None
    except CommError as exc:
        return b"", exc


def allgather_json(obj: Any, group: Any = None) -> list[Any]:
    """Every rank's `obj`, decoded from JSON, in rank order of `group` (collective).

    Every rank checks every size and decodes every message, so a bad message makes *all* ranks raise the
    same `CommError` (nobody is left waiting in a later collective).
    """
    data, own_error = _try_encode(obj)
    world = dist.get_world_size(group)
    size = torch.tensor([_UNENCODABLE if own_error else len(data)], dtype=torch.int64)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(sizes, size, group=group)
    if own_error is not None:
        raise own_error
    lengths = [_checked_size(int(s.item()), f"rank {r}") for r, s in enumerate(sizes)]
    longest = max(lengths)
    out = [torch.zeros(longest, dtype=torch.uint8) for _ in range(world)]
    dist.all_gather(out, _as_tensor(data, longest), group=group)
    return [decode_message(o[:n].numpy().tobytes(), f"rank {r}") for r, (o, n) in enumerate(zip(out, lengths))]


def broadcast_json(obj: Any, src: int = 0, group: Any = None) -> Any:
    """`obj` of rank `src` (a global rank, as `dist.broadcast`), decoded from JSON, on every rank of `group`,
    `src` included, so all ranks hold equal values (tuples arrive as lists). Collective.

    The JSON replacement for ``dist.broadcast_object_list([obj], src)``; the other ranks' `obj` is ignored.
    """
    is_src = dist.get_rank() == src
    data, own_error = _try_encode(obj) if is_src else (b"", None)
    size = torch.tensor([_UNENCODABLE if own_error else len(data)], dtype=torch.int64)
    dist.broadcast(size, src=src, group=group)
    if own_error is not None:
        raise own_error
    n = _checked_size(int(size.item()), f"rank {src}")
    payload = _as_tensor(data, n)
    dist.broadcast(payload, src=src, group=group)
    return decode_message(payload.numpy().tobytes(), f"rank {src}")
