"""Security: the embedded coordination store against peers that are not the job (issue 14, item 7).

Real sockets against a real `EmbeddedStoreServer` in this process; every timing bound is generous (the
CI machine is shared), but far below what the attack achieved before.
"""
from __future__ import annotations

import json
import logging
import os
import re
import select
import socket
import struct
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from deadpool_ext.store import EmbeddedStoreServer, StoreError, connect
from deadpool_ext.store.auth import (
    MAX_FRAME_BYTES,
    PREAUTH_FRAME_BYTES,
    FrameError,
    b64,
    client_proof,
    decode_frame,
    recv_frame,
    send_frame,
    unb64,
)

# Per test; the fuzz targets scale with the example count (DEADPOOL_FUZZ_EXAMPLES, 10,000 in the campaign).
pytestmark = pytest.mark.timeout(120 + int(os.environ.get("DEADPOOL_FUZZ_EXAMPLES", "200")) // 10)

TOKEN = "job-token-for-tests"
_HEADER = struct.Struct(">I")


class _Records(logging.Handler):
    """Collects the records of logger deadpool_ext (usable from module-scoped fixtures, unlike caplog)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def lines(self, level: int = logging.WARNING) -> list[str]:
        return [r.getMessage() for r in self.records if r.levelno >= level]


@pytest.fixture
def records() -> Iterator[_Records]:
    handler = _Records()
    logger = logging.getLogger("deadpool_ext")
    old = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    yield handler
    logger.removeHandler(handler)
    logger.setLevel(old)


def _raw(server: EmbeddedStoreServer, timeout: float = 5.0) -> socket.socket:
    return socket.create_connection(server.address, timeout=timeout)


def _authenticated(server: EmbeddedStoreServer) -> socket.socket:
    """A raw connection that completed the handshake with the job's token (an authenticated peer)."""
    sock = _raw(server)
    hello = recv_frame(sock, PREAUTH_FRAME_BYTES)
    server_nonce, client_nonce = unb64(hello["nonce"], "nonce"), os.urandom(32)
    send_frame(sock, {"op": "auth", "nonce": b64(client_nonce),
                      "mac": client_proof(TOKEN.encode(), server_nonce, client_nonce)})
    assert recv_frame(sock, PREAUTH_FRAME_BYTES)["ok"] is True
    return sock


def _closed_within(sock: socket.socket, seconds: float) -> bool:
    """True if the peer closes `sock` within `seconds` (reading and discarding whatever it sends)."""
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        ready, _, _ = select.select([sock], [], [], left)
        if ready:
            try:
                if sock.recv(65536) == b"":
                    return True
            except ConnectionError:
                return True
    return False


def _rss_bytes() -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/self/status")


def _still_serves(server: EmbeddedStoreServer) -> None:
    with connect(server.url, TOKEN, "check", timeout_s=5.0) as store:
        store.set("alive", b"yes")
        assert store.get("alive") == b"yes"


# -- the handshake deadline ------------------------------------------------------------------------------

def test_slowloris_handshake_is_cut_at_the_deadline() -> None:
    """A byte every 0.3 s used to hold a pre-auth connection indefinitely (the timeout restarted per recv)."""
    auth_timeout_s = 1.5
    with EmbeddedStoreServer(token=TOKEN, auth_timeout_s=auth_timeout_s) as server:
        sock = _raw(server)
        start = time.monotonic()
        recv_frame(sock, PREAUTH_FRAME_BYTES)               # the challenge
        sock.sendall(_HEADER.pack(300))                     # announce a plausible auth frame...
        closed_after = None
        for _ in range(40):                                 # ...and trickle it, up to 12 s
            try:
                sock.sendall(b" ")
            except OSError:
                closed_after = time.monotonic() - start
                break
            if _closed_within(sock, 0.3):
                closed_after = time.monotonic() - start
                break
        sock.close()
        assert closed_after is not None and closed_after < auth_timeout_s + 1.5, closed_after
        _still_serves(server)
    assert any("not completed within 1.5s" in why for _, why in server.refusals), server.refusals


def test_client_handshake_against_a_trickling_server_has_a_deadline() -> None:
    """A process squatting on the store's port, answering one byte at a time, cannot hold a client."""
    squatter = socket.create_server(("127.0.0.1", 0))
    port = squatter.getsockname()[1]
    stop = threading.Event()

    def trickle() -> None:
        conn, _ = squatter.accept()
        hello = json.dumps({"v": 1, "nonce": "A" * 44}).encode()
        for byte in _HEADER.pack(len(hello)) + hello:
            if stop.wait(0.3):
                break
            try:
                conn.sendall(bytes([byte]))
            except OSError:
                break
        conn.close()
    t = threading.Thread(target=trickle, daemon=True)
    t.start()
    start = time.monotonic()
    with pytest.raises(StoreError, match="did not complete within 1s"):
        connect(f"dp://127.0.0.1:{port}", TOKEN, "job", timeout_s=1.0)
    assert time.monotonic() - start < 1.0 + 1.5
    stop.set()
    t.join(5)
    squatter.close()


def test_authenticated_frame_must_arrive_by_its_deadline() -> None:
    with EmbeddedStoreServer(token=TOKEN, frame_timeout_s=1.0) as server:
        sock = _authenticated(server)
        sock.sendall(_HEADER.pack(1000) + b'{"op":')       # header, part of a body, then nothing
        start = time.monotonic()
        assert _closed_within(sock, 1.0 + 1.5)
        assert time.monotonic() - start < 1.0 + 1.5
        sock.close()
        _still_serves(server)
    assert any("did not arrive within 1s" in why for _, why in server.refusals), server.refusals


# -- the connection cap ----------------------------------------------------------------------------------

def test_connections_beyond_the_cap_are_refused_with_a_log_line() -> None:
    with EmbeddedStoreServer(token=TOKEN, max_connections=4, auth_timeout_s=30) as server:
        client = connect(server.url, TOKEN, "job", timeout_s=5.0)          # 1 slot, pooled
        held = [_raw(server) for _ in range(3)]                            # 3 pre-auth slots: the cap is full
        for sock in held:
            recv_frame(sock, PREAUTH_FRAME_BYTES)                          # each got its challenge
        extra = _raw(server)
        start = time.monotonic()
        assert _closed_within(extra, 2.0)                                  # refused on accept...
        assert time.monotonic() - start < 2.0                              # ...not after auth_timeout_s
        extra.close()
        client.set("k", b"v")                                              # an admitted client keeps working
        assert client.get("k") == b"v"
        for sock in held:
            sock.close()
        deadline = time.monotonic() + 5
        while True:                                                        # slots free once handlers notice
            try:
                _still_serves(server)
                break
            except StoreError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        client.close()
    assert any("4 connections already open (max_connections)" in why for _, why in server.refusals), server.refusals


def test_bad_limits_are_one_clear_error() -> None:
    with pytest.raises(ValueError, match="max_connections must be a positive int, got 0"):
        EmbeddedStoreServer(token=TOKEN, max_connections=0)
    with pytest.raises(ValueError, match="auth_timeout_s must be a positive finite number"):
        EmbeddedStoreServer(token=TOKEN, auth_timeout_s=float("nan"))
    with pytest.raises(ValueError, match=f"max_frame_bytes must be at most {MAX_FRAME_BYTES}"):
        EmbeddedStoreServer(token=TOKEN, max_frame_bytes=MAX_FRAME_BYTES + 1)


# -- refusal logs ----------------------------------------------------------------------------------------

def test_refusal_logs_are_rate_limited_with_a_count(records: _Records) -> None:
    """Every refused connection used to log one line: a flood of wrong tokens was a flood of log lines."""
    n = 30
    server = EmbeddedStoreServer(token=TOKEN).start()
    start = time.monotonic()
    for _ in range(n):
        with pytest.raises(StoreError, match="wrong token"):
            connect(server.url, "not-the-token", "job", timeout_s=5.0)
    burst_s = time.monotonic() - start
    during = [m for m in records.lines() if "refused" in m]
    server.stop()
    after = [m for m in records.lines() if "refused" in m]
    individual = [m for m in after if "refused connection from" in m]
    counted = len(individual) + sum(int(x) for m in after for x in re.findall(r"(\d+) more", m))
    assert counted == n == len(server.refusals), after
    # one interval: one line, then the count at stop; and never a token
    assert (burst_s >= 5.0 or (len(during) == 1 and "wrong token" in during[0] and len(after) == 2  # log-interface:
            and f"{n - 1} more connections refused" in after[1])) and not any(  # the log's volume is what is tested
        s in m for m in after for s in (TOKEN, "not-the-token")), after


# -- frame sizes and allocation --------------------------------------------------------------------------

def test_announced_frame_length_is_not_allocated_up_front() -> None:
    """Four authenticated frames announcing 64 MiB each used to cost the server ~260 MB of RSS at once."""
    with EmbeddedStoreServer(token=TOKEN) as server:
        socks = [_authenticated(server) for _ in range(4)]
        time.sleep(0.2)
        before = _rss_bytes()
        for sock in socks:
            sock.sendall(_HEADER.pack(MAX_FRAME_BYTES) + b'{"op": "get", ')
        time.sleep(1.0)                                   # the handler threads are blocked in recv by now
        grown = _rss_bytes() - before
        for sock in socks:
            sock.close()
        _still_serves(server)
    assert grown < 32 << 20, f"server RSS grew by {grown >> 20} MiB"


def test_oversized_frame_is_refused_and_logged() -> None:
    with EmbeddedStoreServer(token=TOKEN, max_frame_bytes=1 << 20) as server:
        sock = _authenticated(server)
        sock.sendall(_HEADER.pack((1 << 20) + 1))
        assert _closed_within(sock, 5.0)
        sock.close()
        _still_serves(server)
    assert any(f"frame of {(1 << 20) + 1} bytes exceeds the limit of {1 << 20}" in why for _, why in server.refusals)


def test_client_refuses_a_value_too_large_for_a_frame() -> None:
    with EmbeddedStoreServer(token=TOKEN) as server, connect(server.url, TOKEN, "job", timeout_s=5.0) as store:
        with pytest.raises(StoreError, match="'set' request to the coordination store .* is too large"):
            store.set("big", b"\0" * (MAX_FRAME_BYTES * 3 // 4 + 1))   # base64 makes it > MAX_FRAME_BYTES
        store.set("after", b"ok")                                     # the connection pool is intact
        assert store.get("after") == b"ok"


# -- malformed frames from an authenticated peer ---------------------------------------------------------

def _ask(sock: socket.socket, req: dict[str, Any]) -> dict[str, Any]:
    send_frame(sock, req)
    return recv_frame(sock, deadline=time.monotonic() + 5)


def test_deeply_nested_frame_is_refused_not_a_crash(records: _Records) -> None:
    """json.loads raised RecursionError, which escaped the frame parser ('internal error' + traceback)."""
    with pytest.raises(FrameError, match="nested too deeply"):
        decode_frame(b"[" * 100_000)
    with EmbeddedStoreServer(token=TOKEN) as server:
        sock = _authenticated(server)
        body = b"[" * 100_000
        sock.sendall(_HEADER.pack(len(body)) + body)
        assert _closed_within(sock, 5.0)
        sock.close()
        pre = _raw(server)                                  # and before authentication
        recv_frame(pre, PREAUTH_FRAME_BYTES)
        pre.sendall(_HEADER.pack(4000) + b"{" * 4000)
        assert _closed_within(pre, 5.0)
        pre.close()
        _still_serves(server)
    assert not [r for r in records.records if r.levelno >= logging.ERROR], records.lines(logging.ERROR)


def test_request_values_out_of_range_get_an_error_reply(records: _Records) -> None:
    """A wait timeout of 10**400 raised OverflowError inside the server; a counter could grow without bound."""
    with EmbeddedStoreServer(token=TOKEN) as server:
        sock = _authenticated(server)
        reply = _ask(sock, {"op": "wait", "keys": ["x"], "timeout": 10 ** 400})
        assert reply == {"ok": False, "error": "wait needs a positive finite 'timeout'"}
        reply = _ask(sock, {"op": "add", "key": "c", "delta": 1 << 70})
        assert reply["ok"] is False and "signed 64-bit range" in reply["error"]
        assert _ask(sock, {"op": "add", "key": "c", "delta": 2})["value"] == 2     # same connection, still fine
        sock.close()
    assert not [r for r in records.records if r.levelno >= logging.ERROR], records.lines(logging.ERROR)


# -- fuzz ------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def fuzz_server() -> Iterator[tuple[EmbeddedStoreServer, _Records]]:
    handler = _Records()
    logger = logging.getLogger("deadpool_ext")
    logger.addHandler(handler)
    with EmbeddedStoreServer(token=TOKEN, auth_timeout_s=2.0, frame_timeout_s=2.0) as server:
        yield server, handler
    logger.removeHandler(handler)


def _no_internal_errors(handler: _Records) -> None:
    errors = [r for r in handler.records if r.levelno >= logging.ERROR]
    assert not errors, [r.getMessage() for r in errors]


frames = st.one_of(
    st.binary(max_size=6000),
    st.builds(lambda n, body: _HEADER.pack(n) + body, st.integers(0, 2**32 - 1), st.binary(max_size=256)),
    st.builds(lambda body: _HEADER.pack(len(body)) + body, st.binary(max_size=4096)),
    st.builds(lambda n: _HEADER.pack(n) + b"[" * n, st.integers(1, 4096)),
)


@given(frames)
def test_fuzz_decode_frame(data: bytes) -> None:
    """The frame-body parser: a dict, or FrameError; nothing else escapes."""
    try:
        assert isinstance(decode_frame(data), dict)
    except FrameError:
        pass


@given(frames)
def test_fuzz_recv_frame(data: bytes) -> None:
    """The frame reader on a socket carrying arbitrary bytes then EOF: a dict or FrameError, nothing else."""
    a, b = socket.socketpair()
    with a, b:
        a.sendall(data)
        a.shutdown(socket.SHUT_WR)
        try:
            assert isinstance(recv_frame(b, PREAUTH_FRAME_BYTES, deadline=time.monotonic() + 5), dict)
        except FrameError:
            pass


@given(frames)
def test_fuzz_server_before_auth(fuzz_server: tuple[EmbeddedStoreServer, _Records], data: bytes) -> None:
    """Arbitrary bytes in place of the handshake: the connection is dropped, the server keeps serving, and
    nothing but a refusal is logged."""
    server, handler = fuzz_server
    with _raw(server) as sock:
        recv_frame(sock, PREAUTH_FRAME_BYTES)
        try:
            sock.sendall(data)
            sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass                                            # the server may already have dropped us
        assert _closed_within(sock, 5.0)
    _still_serves(server)
    _no_internal_errors(handler)


_OPS = ["get", "set", "add", "cas", "delete", "list", "wait", "auth", "", "GET"]
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.integers(-2**80, 2**80) | st.floats() | st.text(max_size=16)
    | st.binary(max_size=16).map(b64),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=20)
# A wait that is valid would block until its deadline: keep valid timeouts short.
timeouts = st.one_of(json_values, st.floats(min_value=0.001, max_value=0.05), st.integers(-5, 0),
                     st.just(10 ** 400), st.just(float("inf")))
requests = st.builds(
    lambda op, fields, timeout: {**fields, "op": op, **({"timeout": timeout} if op == "wait" else {})},
    st.sampled_from(_OPS) | st.text(max_size=8),
    st.dictionaries(st.sampled_from(["key", "value", "delta", "expected", "new", "prefix", "keys", "nonce"]),
                    json_values, max_size=5),
    timeouts)


@given(st.lists(requests, min_size=1, max_size=4))
def test_fuzz_server_requests(fuzz_server: tuple[EmbeddedStoreServer, _Records], batch: list[dict[str, Any]]) -> None:
    """Arbitrary requests from an authenticated peer: each gets a reply frame ({"ok": true|false, ...}) on the
    same connection; no internal error; a good client is served afterwards."""
    server, handler = fuzz_server
    with _authenticated(server) as sock:
        for req in batch:
            reply = _ask(sock, req)
            assert isinstance(reply.get("ok"), bool), reply
    _still_serves(server)
    _no_internal_errors(handler)


@given(frames)
def test_fuzz_server_after_auth(fuzz_server: tuple[EmbeddedStoreServer, _Records], data: bytes) -> None:
    """Arbitrary bytes from an authenticated peer: replies or a dropped connection, never an internal error."""
    server, handler = fuzz_server
    with _authenticated(server) as sock:
        try:
            sock.sendall(data)
            sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        assert _closed_within(sock, 5.0)
    _still_serves(server)
    _no_internal_errors(handler)


# -- etcd client against a server that is not etcd ---------------------------------------------------------

def test_etcd_client_turns_malformed_replies_into_store_errors() -> None:
    """A proxy or impostor on etcd's port: nested JSON, non-objects, missing fields, bad base64 were
    RecursionError / KeyError / binascii.Error from inside the client; each is one StoreError now."""
    import http.server

    from deadpool_ext.store.etcd import EtcdStore

    answers: dict[str, bytes] = {}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            body = answers.get(self.path, b"{}")
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{httpd.server_address[1]}"
    try:
        for bad in (b"[" * 100_000, b"[1, 2]", b"\xff\xfe", b"1" * 5000):
            answers["/v3/auth/authenticate"] = bad
            with pytest.raises(StoreError, match="etcd at"):
                EtcdStore(url, token=TOKEN, namespace="job", timeout_s=5.0)
        answers["/v3/auth/authenticate"] = b'{"token": "t"}'
        store = EtcdStore(url, token=TOKEN, namespace="job", timeout_s=5.0)
        for path, body, call in (
                ("/v3/kv/range", b'{"kvs": [{"value": "!!not base64"}]}', lambda: store.get("k")),
                ("/v3/kv/range", b'{"kvs": [{"value": "eA=="}]}', lambda: store.list("")),       # no "key"
                ("/v3/kv/range", b'{"kvs": "x"}', lambda: store.add("c", 1)),
                ("/v3/kv/txn", b'{"responses": 7}', lambda: store.wait(["a"], 0.2)),
                ("/v3/kv/deleterange", b'{"deleted": "many"}', lambda: store.delete("k"))):
            answers[path] = body
            with pytest.raises(StoreError, match="etcd at"):
                call()
            answers.pop(path)
        store.close()
    finally:
        httpd.shutdown()
        httpd.server_close()
