"""The embedded store's wire frames and its token handshake (HMAC-SHA256 challenge-response, both ways).

Frames: 4-byte big-endian length + one UTF-8 JSON object; byte values travel base64-encoded. JSON,
never pickle, so a peer cannot make the other side execute code; a size limit (tiny before
authentication) so an unauthenticated peer cannot make the server allocate much, and a frame's buffer
grows with the bytes that actually arrived (an announced length alone allocates nothing). Malformed
frames of any kind (bad UTF-8, bad JSON, nesting deep enough to exhaust the recursion limit, integers
longer than Python parses) raise `FrameError` and nothing else. The handshake has one deadline for the
whole exchange, so a peer trickling bytes cannot hold a connection longer than that.

Why challenge-response rather than sending the token: the token is the job's only secret and
anything on the wire can be captured, so only one-use proofs over fresh nonces cross it. Why both
ways: the client also checks the server's proof, so a process squatting on the launcher's port
cannot collect the job's state or hand out fake assignments.

Handshake order (one round trip after connecting):

1. server -> client  ``{"v": 1, "nonce": b64(server_nonce)}``
2. client -> server  ``{"op": "auth", "nonce": b64(client_nonce), "mac": hex(client_proof)}``
3. server -> client  ``{"ok": true, "mac": hex(server_proof)}``  or ``{"ok": false, "error": ...}`` + close

The two proofs carry different labels, so one side's proof can never be replayed as the other's.
"""
from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import os
import socket
import struct
import time
from collections.abc import Callable
from typing import Any

from deadpool_ext.store.base import StoreAuthError, StoreError

__all__ = ["PROTOCOL_VERSION", "MAX_FRAME_BYTES", "FrameError", "PeerClosed", "send_frame", "recv_frame",
           "decode_frame", "encode_frame", "b64", "unb64", "client_proof", "server_proof", "server_handshake",
           "client_handshake"]

PROTOCOL_VERSION = 1
NONCE_BYTES = 32
MAX_FRAME_BYTES = 64 << 20      # a value larger than this belongs in shared memory, not the store
PREAUTH_FRAME_BYTES = 4096
_CHUNK = 1 << 16                # a frame's buffer grows by what arrived, never by what was announced
_HEADER = struct.Struct(">I")
_CLIENT_LABEL = b"deadpool-store v1 client proof\x00"
_SERVER_LABEL = b"deadpool-store v1 server proof\x00"


class FrameError(Exception):
    """The peer sent something that is not a valid frame, or hung up."""


class PeerClosed(FrameError):
    """The peer hung up (between frames or in the middle of one): the end of a connection, not an attack."""


def _remaining(deadline: float | None) -> float | None:
    if deadline is None:
        return None
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("deadline passed")
    return left


def encode_frame(obj: dict[str, Any], limit: int = MAX_FRAME_BYTES) -> bytes:
    """The frame for `obj`; `FrameError` if it would exceed `limit` (which the peer would refuse)."""
    data = json.dumps(obj, separators=(",", ":")).encode()
    if len(data) > limit:
        raise FrameError(f"frame of {len(data)} bytes exceeds the limit of {limit}")
    return _HEADER.pack(len(data)) + data


def send_frame(sock: socket.socket, obj: dict[str, Any], deadline: float | None = None,
               limit: int = MAX_FRAME_BYTES) -> None:
    """Send one frame; with `deadline` (a `time.monotonic()` value) the whole send must finish by then."""
    frame = encode_frame(obj, limit)
    if deadline is not None:
        sock.settimeout(_remaining(deadline))
    sock.sendall(frame)


def _recv_exact(sock: socket.socket, n: int, deadline: float | None) -> bytearray:
    """`n` bytes; the buffer grows with the bytes received (an announced length costs nothing by itself).

    With `deadline`, every recv gets only the time left, so a peer trickling one byte at a time cannot
    stretch the wait (a per-recv timeout would restart with each byte)."""
    buf = bytearray()
    chunk = bytearray(min(n, _CHUNK))
    view = memoryview(chunk)
    while len(buf) < n:
        if deadline is not None:
            sock.settimeout(_remaining(deadline))
        k = sock.recv_into(view[: min(n - len(buf), len(chunk))])
        if k == 0:
            raise PeerClosed("connection closed by peer" if not buf else "peer hung up mid-frame")
        buf += view[:k]
    return buf


def decode_frame(data: bytes | bytearray) -> dict[str, Any]:
    """A frame's body -> its JSON object; `FrameError` for anything else (never another exception)."""
    try:
        obj = json.loads(data.decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise FrameError(f"frame is not JSON: {exc}") from None
    except RecursionError:
        raise FrameError("frame is nested too deeply") from None
    except ValueError as exc:   # e.g. an integer literal longer than Python's int_max_str_digits
        raise FrameError(f"frame is not usable JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise FrameError("frame is not a JSON object")
    return obj


def recv_frame(sock: socket.socket, limit: int = MAX_FRAME_BYTES, deadline: float | None = None,
               body_timeout_s: float | None = None) -> dict[str, Any]:
    """One frame. `deadline` (monotonic) bounds the whole frame, header included; `body_timeout_s` bounds
    the rest of the frame once its header arrived (for connections that may idle between frames).
    Raises `FrameError` (bad or oversized frame, hang-up) or `TimeoutError`."""
    (size,) = _HEADER.unpack(_recv_exact(sock, _HEADER.size, deadline))
    if size > limit:
        raise FrameError(f"frame of {size} bytes exceeds the limit of {limit}")
    if body_timeout_s is not None:
        body_deadline = time.monotonic() + body_timeout_s
        deadline = body_deadline if deadline is None else min(deadline, body_deadline)
    return decode_frame(_recv_exact(sock, size, deadline))


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def unb64(text: object, what: str) -> bytes:
    """Decode a base64 field from a peer; ValueError (never a crash) on anything else."""
    if not isinstance(text, str):
        raise ValueError(f"{what} must be a base64 string")
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError(f"{what} is not valid base64") from None


def _mac(token: bytes, label: bytes, server_nonce: bytes, client_nonce: bytes) -> str:
    return hmac.new(token, label + server_nonce + client_nonce, hashlib.sha256).hexdigest()


def client_proof(token: bytes, server_nonce: bytes, client_nonce: bytes) -> str:
    """What the client sends to show it knows `token` (hex HMAC-SHA256)."""
    return _mac(token, _CLIENT_LABEL, server_nonce, client_nonce)


def server_proof(token: bytes, server_nonce: bytes, client_nonce: bytes) -> str:
    """What the server sends back to show *it* knows `token` too."""
    return _mac(token, _SERVER_LABEL, server_nonce, client_nonce)


def _matches(expected: str, received: object) -> bool:
    return isinstance(received, str) and hmac.compare_digest(expected.encode(), received.encode("utf-8", "replace"))


def _secs(timeout_s: float | None) -> str:
    return "the socket timeout" if timeout_s is None else f"{timeout_s:g}s"


def server_handshake(sock: socket.socket, token: bytes, refused: Callable[[str], None],
                     timeout_s: float | None = None, deadline: float | None = None) -> bool:
    """Server side; True if the peer proved it knows `token`.

    `timeout_s` bounds the *whole* handshake (a deadline, not a per-recv timeout: a peer sending one
    byte now and then is dropped when it runs out). On refusal calls ``refused(reason)`` *before*
    answering, so the refusal is logged by the time the peer sees its error; a wrong token gets an
    error frame, a malformed handshake just a close. `deadline` (monotonic), when given, replaces
    now + `timeout_s` (a connection that waited for its handshake slot has only what is left of it).
    """
    if deadline is None:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
    server_nonce = os.urandom(NONCE_BYTES)
    try:
        send_frame(sock, {"v": PROTOCOL_VERSION, "nonce": b64(server_nonce)}, deadline)
        msg = recv_frame(sock, PREAUTH_FRAME_BYTES, deadline)
        client_nonce = unb64(msg.get("nonce"), "nonce")
    except TimeoutError:
        refused(f"bad handshake (not completed within {_secs(timeout_s)})")
        return False
    except (FrameError, ValueError) as exc:
        refused(f"bad handshake ({exc})")
        return False
    if msg.get("op") != "auth" or len(client_nonce) != NONCE_BYTES \
            or not _matches(client_proof(token, server_nonce, client_nonce), msg.get("mac")):
        refused("wrong token")
        try:
            send_frame(sock, {"ok": False, "error": "authentication failed: wrong token for this job"}, deadline)
        except (TimeoutError, OSError):
            pass
        return False
    try:
        send_frame(sock, {"ok": True, "mac": server_proof(token, server_nonce, client_nonce)}, deadline)
    except TimeoutError:
        refused(f"bad handshake (not completed within {_secs(timeout_s)})")
        return False
    return True


def client_handshake(sock: socket.socket, token: bytes, where: str, timeout_s: float | None = None) -> None:
    """Client side; raises `StoreAuthError` if either side's proof fails, `StoreError` on protocol trouble.

    `timeout_s` bounds the whole handshake (a server trickling its answer cannot hold the client longer).
    """
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    try:
        hello = recv_frame(sock, PREAUTH_FRAME_BYTES, deadline)
        if hello.get("v") != PROTOCOL_VERSION:
            raise StoreError(f"{where} speaks store protocol {hello.get('v')!r}, this client {PROTOCOL_VERSION}")
        server_nonce = unb64(hello.get("nonce"), "nonce")
        client_nonce = os.urandom(NONCE_BYTES)
        send_frame(sock, {"op": "auth", "nonce": b64(client_nonce),
                          "mac": client_proof(token, server_nonce, client_nonce)}, deadline)
        reply = recv_frame(sock, PREAUTH_FRAME_BYTES, deadline)
    except TimeoutError:
        raise StoreError(f"handshake with the coordination store at {where} did not complete within "
                         f"{_secs(timeout_s)}") from None
    except (OSError, FrameError, ValueError) as exc:
        raise StoreError(f"handshake with the coordination store at {where} failed: {exc}") from exc
    if not reply.get("ok"):
        raise StoreAuthError(f"coordination store at {where} refused this process: "
                             f"{str(reply.get('error', 'authentication failed'))[:200]}")
    if not _matches(server_proof(token, server_nonce, client_nonce), reply.get("mac")):
        raise StoreAuthError(f"the server at {where} could not prove it knows the job's token; not the job's store?")
