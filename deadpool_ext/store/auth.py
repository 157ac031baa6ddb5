"""The embedded store's wire frames and its token handshake (HMAC-SHA256 challenge-response, both ways).

Frames: 4-byte big-endian length + one UTF-8 JSON object; byte values travel base64-encoded. JSON,
never pickle, so a peer cannot make the other side execute code; a size limit (tiny before
authentication) so an unauthenticated peer cannot make the server allocate much.

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
from collections.abc import Callable
from typing import Any

from deadpool_ext.store.base import StoreAuthError, StoreError

__all__ = ["PROTOCOL_VERSION", "MAX_FRAME_BYTES", "FrameError", "send_frame", "recv_frame", "b64", "unb64",
           "client_proof", "server_proof", "server_handshake", "client_handshake"]

PROTOCOL_VERSION = 1
NONCE_BYTES = 32
MAX_FRAME_BYTES = 64 << 20      # a value larger than this belongs in shared memory, not the store
PREAUTH_FRAME_BYTES = 4096
_HEADER = struct.Struct(">I")
_CLIENT_LABEL = b"deadpool-store v1 client proof\x00"
_SERVER_LABEL = b"deadpool-store v1 server proof\x00"


class FrameError(Exception):
    """The peer sent something that is not a valid frame, or hung up."""


def send_frame(sock: socket.socket, obj: dict[str, Any]) -> None:
    data = json.dumps(obj, separators=(",", ":")).encode()
    sock.sendall(_HEADER.pack(len(data)) + data)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            raise FrameError("connection closed by peer" if got == 0 else "peer hung up mid-frame")
        got += k
    return bytes(buf)


def recv_frame(sock: socket.socket, limit: int = MAX_FRAME_BYTES) -> dict[str, Any]:
    (size,) = _HEADER.unpack(_recv_exact(sock, _HEADER.size))
    if size > limit:
        raise FrameError(f"frame of {size} bytes exceeds the limit of {limit}")
    try:
        obj = json.loads(_recv_exact(sock, size).decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise FrameError(f"frame is not JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise FrameError("frame is not a JSON object")
    return obj


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


def server_handshake(sock: socket.socket, token: bytes, refused: Callable[[str], None]) -> bool:
    """Server side; True if the peer proved it knows `token`.

    On refusal calls ``refused(reason)`` *before* answering, so the refusal is logged by the time the
    peer sees its error; a wrong token gets an error frame, a malformed handshake just a close.
    """
    server_nonce = os.urandom(NONCE_BYTES)
    send_frame(sock, {"v": PROTOCOL_VERSION, "nonce": b64(server_nonce)})
    try:
        msg = recv_frame(sock, PREAUTH_FRAME_BYTES)
        client_nonce = unb64(msg.get("nonce"), "nonce")
    except (TimeoutError, FrameError, ValueError) as exc:
        refused(f"bad handshake ({exc or 'timed out'})")
        return False
    if msg.get("op") != "auth" or len(client_nonce) != NONCE_BYTES \
            or not _matches(client_proof(token, server_nonce, client_nonce), msg.get("mac")):
        refused("wrong token")
        send_frame(sock, {"ok": False, "error": "authentication failed: wrong token for this job"})
        return False
    send_frame(sock, {"ok": True, "mac": server_proof(token, server_nonce, client_nonce)})
    return True


def client_handshake(sock: socket.socket, token: bytes, where: str) -> None:
    """Client side; raises `StoreAuthError` if either side's proof fails, `StoreError` on protocol trouble."""
    try:
        hello = recv_frame(sock, PREAUTH_FRAME_BYTES)
        if hello.get("v") != PROTOCOL_VERSION:
            raise StoreError(f"{where} speaks store protocol {hello.get('v')!r}, this client {PROTOCOL_VERSION}")
        server_nonce = unb64(hello.get("nonce"), "nonce")
        client_nonce = os.urandom(NONCE_BYTES)
        send_frame(sock, {"op": "auth", "nonce": b64(client_nonce),
                          "mac": client_proof(token, server_nonce, client_nonce)})
        reply = recv_frame(sock, PREAUTH_FRAME_BYTES)
    except (OSError, FrameError, ValueError) as exc:
        raise StoreError(f"handshake with the coordination store at {where} failed: {exc}") from exc
    if not reply.get("ok"):
        raise StoreAuthError(f"coordination store at {where} refused this process: "
                             f"{reply.get('error', 'authentication failed')}")
    if not _matches(server_proof(token, server_nonce, client_nonce), reply.get("mac")):
        raise StoreAuthError(f"the server at {where} could not prove it knows the job's token; not the job's store?")
