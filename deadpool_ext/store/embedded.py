"""The embedded coordination store: a small threaded TCP server the launcher runs in-process, and its client.

Why embedded by default: a single-host (or few-host) job should not need an extra daemon; the
launcher already outlives every worker, so it serves the store. For many hosts, use etcd instead
(`deadpool_ext.store.etcd`); the client interface is the same.

Wire format: every message is a frame = 4-byte big-endian length + UTF-8 JSON object; byte values
travel base64-encoded. No pickle: a peer cannot make the server or a client run code. Each
connection first completes the HMAC handshake in `deadpool_ext.store.auth` (the token never crosses
the wire), then sends requests ``{"op": ..., ...}`` one at a time, each answered by
``{"ok": true, ...}`` or ``{"ok": false, "error": "..."}``.

What an unauthenticated peer can cost the server (docs/security.md): a slot of its own budget in the
separate pool of handshakes (``store/admission.py``: `max_pending_per_peer` per peer, `max_pending` in all,
a bounded queue beyond) for at most `untrusted_auth_timeout_s` from its accept, a 4 KiB frame, and, past the
first refusal in each `REFUSAL_LOG_INTERVAL_S`, a counter increment instead of a log line. It never takes a
slot of `max_connections`, which only the job's own uid on this host and authenticated peers hold.
"""
from __future__ import annotations

import contextlib
import ipaddress
import logging
import math
import socket
import socketserver
import threading
import time
from collections import deque
from collections.abc import Iterator
from typing import Any

from deadpool_ext.store.admission import (
    DEFAULT_MAX_PENDING,
    DEFAULT_MAX_PENDING_PER_PEER,
    DEFAULT_MAX_QUEUED,
    DEFAULT_MAX_QUEUED_PER_PEER,
    QUEUE,
    REFUSE,
    Admission,
    PeerKey,
    peer_key,
)
from deadpool_ext.store.auth import (
    MAX_FRAME_BYTES,
    FrameError,
    PeerClosed,
    b64,
    client_handshake,
    encode_frame,
    recv_frame,
    server_handshake,
    unb64,
)
from deadpool_ext.store.base import CoordinationStore, StoreError, check_timeout
from deadpool_ext.store.table import Table

__all__ = ["EmbeddedStoreServer", "EmbeddedStore"]

log = logging.getLogger("deadpool_ext")

_MAX_IDLE_CONNECTIONS = 8
DEFAULT_MAX_CONNECTIONS = 512   # a worker holds 2 clients of 1-2 connections each; ~128 workers fit
REFUSAL_LOG_INTERVAL_S = 5.0    # at most one refusal line per interval; the rest are counted


def _check_count(value: int, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{what} must be a positive int, got {value!r}")
    return value


class _RefusalLog:
    """Refused connections, logged at most once per `interval_s`; the ones in between are counted and the
    count (with the last peer and reason) goes into the next line, or into `flush()` at stop."""

    def __init__(self, where: str, interval_s: float = REFUSAL_LOG_INTERVAL_S) -> None:
        self.where, self.interval_s = where, interval_s
        self._lock = threading.Lock()
        self._last_line: float | None = None
        self._suppressed = 0
        self._last: tuple[str, str] = ("", "")
        self.total = 0
        self.recent: deque[tuple[str, str]] = deque(maxlen=256)
        """(peer, reason) of the newest refusals, logged or only counted."""

    def refused(self, peer: str, reason: str) -> None:
        now = time.monotonic()
        with self._lock:
            self.total += 1
            self.recent.append((peer, reason))
            if self._last_line is not None and now - self._last_line < self.interval_s:
                self._suppressed += 1
                self._last = (peer, reason)
                return
            suppressed, self._suppressed, self._last_line = self._suppressed, 0, now
        more = f" ({suppressed} more refused since the previous line, not logged one by one)" if suppressed else ""
        log.warning("coordination store %s: refused connection from %s: %s%s", self.where, peer, reason, more)

    def flush(self) -> None:
        with self._lock:
            suppressed, self._suppressed = self._suppressed, 0
            peer, reason = self._last
        if suppressed:
            log.warning("coordination store %s: %d more connections refused since the previous line, not logged "
                        "one by one (last from %s: %s)", self.where, suppressed, peer, reason)


def _is_wildcard(host: str) -> bool:
    if host == "":
        return True
    try:
        return ipaddress.ip_address(host).is_unspecified
    except ValueError:
        return False


class _TCPServer(socketserver.ThreadingTCPServer):
    daemon_threads = True
    block_on_close = False
    allow_reuse_address = True
    request_queue_size = 1024   # a flood's connections must not fill the backlog ahead of the job's
    owner: EmbeddedStoreServer

    def process_request(self, request: Any, client_address: Any) -> None:
        # Runs on the accept thread: a connection refused or queued starts no thread.
        self.owner._accept(request, client_address)

    def service_actions(self) -> None:
        # serve_forever's loop, every poll interval: queued handshakes whose deadline passed are closed.
        self.owner._sweep()

    def handle_error(self, request: Any, client_address: Any) -> None:
        # socketserver's default prints a traceback to stderr; a failed connection is a refusal line here.
        self.owner._refusals.refused(_peer(client_address), "could not serve the connection (no thread?)")


class _TCPServer6(_TCPServer):
    address_family = socket.AF_INET6


def _who(client_address: Any, key: PeerKey) -> str:
    return _peer(client_address) if key.uid is None else f"{_peer(client_address)} (uid {key.uid})"


def _peer(client_address: Any) -> str:
    try:
        return f"{client_address[0]}:{client_address[1]}"
    except (TypeError, IndexError, KeyError):
        return repr(client_address)


class EmbeddedStoreServer:
    """The launcher-side store server.

    Call order: construct (validates; binds nothing) -> `start()` (binds and serves from a daemon
    thread) -> read `address` / `url` and hand the URL and token to workers -> `stop()` (closes every
    connection; clients blocked in a call get `StoreError`). Also a context manager.

    Binds only to `host` (default loopback). A wildcard host ("" / "0.0.0.0" / "::") listens on every
    interface, which the project forbids by default, so it is refused unless
    ``allow_all_interfaces=True`` is passed on purpose.

    Limits: `auth_timeout_s` is a deadline on the whole handshake of a connection from the job's own uid on this
    host, `untrusted_auth_timeout_s` on any other's (from its accept, queue included); at most
    `max_connections` connections of the job's uid and authenticated peers at once, the ones beyond are closed
    on accept (or after authenticating); other peers' handshakes run in their own pool (`max_pending`,
    `max_pending_per_peer`, then a queue of `max_queued_per_peer` / `max_queued`; ``store/admission.py``); an
    authenticated request frame is at most `max_frame_bytes` and must arrive within `frame_timeout_s` of its
    header. Refusals are logged at most once per `REFUSAL_LOG_INTERVAL_S` with a count.
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0, *, token: str, allow_all_interfaces: bool = False,
                 auth_timeout_s: float = 10.0, max_connections: int = DEFAULT_MAX_CONNECTIONS,
                 max_frame_bytes: int = MAX_FRAME_BYTES, frame_timeout_s: float = 60.0,
                 untrusted_auth_timeout_s: float = 3.0, max_pending: int = DEFAULT_MAX_PENDING,
                 max_pending_per_peer: int = DEFAULT_MAX_PENDING_PER_PEER,
                 max_queued_per_peer: int = DEFAULT_MAX_QUEUED_PER_PEER, max_queued: int = DEFAULT_MAX_QUEUED,
                 own_uid: int | None = None) -> None:
        if not isinstance(token, str) or not token:
            raise ValueError("EmbeddedStoreServer needs a non-empty token: without it anyone could join the job")
        if not isinstance(host, str):
            raise ValueError(f"host must be a str, got {host!r}")
        if _is_wildcard(host) and not allow_all_interfaces:
            raise ValueError(f"refusing to bind the coordination store to {host!r} (every interface); bind a "
                             "specific address, or pass allow_all_interfaces=True if that is really intended")
        if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
            raise ValueError(f"port must be an int in 0..65535, got {port!r}")
        self.host, self.port = host, port
        self._token = token.encode()
        self._auth_timeout_s = check_timeout(auth_timeout_s, "EmbeddedStoreServer auth_timeout_s")
        self._frame_timeout_s = check_timeout(frame_timeout_s, "EmbeddedStoreServer frame_timeout_s")
        self._max_connections = _check_count(max_connections, "EmbeddedStoreServer max_connections")
        self._max_frame_bytes = _check_count(max_frame_bytes, "EmbeddedStoreServer max_frame_bytes")
        if self._max_frame_bytes > MAX_FRAME_BYTES:
            raise ValueError(f"EmbeddedStoreServer max_frame_bytes must be at most {MAX_FRAME_BYTES} (what clients "
                             f"send), got {max_frame_bytes}")
        self._untrusted_auth_timeout_s = check_timeout(untrusted_auth_timeout_s,
                                                       "EmbeddedStoreServer untrusted_auth_timeout_s")
        self._admission = Admission(
            self._max_connections, _check_count(max_pending, "EmbeddedStoreServer max_pending"),
            _check_count(max_pending_per_peer, "EmbeddedStoreServer max_pending_per_peer"),
            _check_count(max_queued_per_peer, "EmbeddedStoreServer max_queued_per_peer"),
            _check_count(max_queued, "EmbeddedStoreServer max_queued"))
        self._own_uid = own_uid   # whose connections on this host are trusted (default: this process's euid)
        self._refusals = _RefusalLog(f"{host}:{port}")
        self._server: _TCPServer | None = None
        self._thread: threading.Thread | None = None
        self._kv: Table | None = None
        self._stopped = False
        self._conns: set[socket.socket] = set()
        self._conns_lock = threading.Lock()

    def start(self) -> EmbeddedStoreServer:
        if self._server is not None:
            raise RuntimeError("EmbeddedStoreServer.start() called twice")
        server_cls = _TCPServer6 if ":" in self.host else _TCPServer
        try:
            server = server_cls((self.host, self.port), socketserver.BaseRequestHandler)
        except OSError as exc:
            raise StoreError(f"cannot bind the coordination store to {self.host}:{self.port}: {exc}") from exc
        server.owner = self
        self._server = server
        self._kv = Table(self.url)
        self._refusals.where = self.url
        self._thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.2},
                                        name=f"deadpool-store {self.url}", daemon=True)
        self._thread.start()
        log.info("coordination store listening on %s", self.url)
        return self

    @property
    def refusals(self) -> list[tuple[str, str]]:
        """(peer, reason) of the newest 256 connections this server refused (its log says the same, rate-limited:
        see ``REFUSAL_LOG_INTERVAL_S``)."""
        with self._refusals._lock:
            return list(self._refusals.recent)

    @property
    def address(self) -> tuple[str, int]:
        """(host, port) actually bound; the port is the kernel's pick when constructed with port=0."""
        if self._server is None:
            raise RuntimeError("EmbeddedStoreServer.address read before start()")
        addr = self._server.server_address
        return str(addr[0]), int(addr[1])

    @property
    def url(self) -> str:
        host, port = self.address
        return f"dp://[{host}]:{port}" if ":" in host else f"dp://{host}:{port}"

    def stop(self) -> None:
        """Idempotent; `address` / `url` stay readable afterwards for error messages."""
        if self._server is None or self._stopped:
            return
        self._stopped = True
        assert self._kv is not None
        with self._kv.cond:
            self._kv.stopping = True
            self._kv.cond.notify_all()
        self._server.shutdown()
        self._server.server_close()
        for item in self._admission.expired(now=math.inf):   # still waiting for a handshake slot
            self._server.shutdown_request(item[0])
        with self._conns_lock:
            conns = list(self._conns)
        for sock in conns:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        if self._thread is not None:
            self._thread.join(timeout=5.0)
        self._refusals.flush()
        log.info("coordination store on %s stopped", self.url)

    def __enter__(self) -> EmbeddedStoreServer:
        return self.start() if self._server is None else self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- per-connection --------------------------------------------------------------------------
    def _accept(self, sock: socket.socket, client_address: Any) -> None:
        """On the accept thread: which pool, then a thread, a place in the peer's queue, or a refusal."""
        assert self._server is not None
        key = peer_key(sock, client_address, self._own_uid)
        timeout = self._auth_timeout_s if key.trusted else self._untrusted_auth_timeout_s
        deadline = time.monotonic() + timeout
        verdict, why = self._admission.arrive(key, (sock, client_address), deadline)
        if verdict == REFUSE:
            self._refusals.refused(_who(client_address, key), why)
            self._server.shutdown_request(sock)
        elif verdict != QUEUE:
            self._start(sock, client_address, key, deadline)

    def _start(self, sock: socket.socket, client_address: Any, key: PeerKey, deadline: float) -> None:
        try:
            threading.Thread(target=self._connection, args=(sock, client_address, key, deadline),
                             name="deadpool-store-conn", daemon=True).start()
        except RuntimeError:   # no thread: the connection is given up, its slot freed
            self._refusals.refused(_who(client_address, key), "could not serve the connection (no thread)")
            self._release(key, handshaking=not key.trusted, slot=key.trusted)
            assert self._server is not None
            self._server.shutdown_request(sock)

    def _sweep(self) -> None:
        assert self._server is not None
        for sock, client_address in self._admission.expired():
            self._refusals.refused(_peer(client_address), f"bad handshake (waited past its deadline of "
                                                          f"{self._untrusted_auth_timeout_s:g}s for a handshake slot)")
            self._server.shutdown_request(sock)

    def _release(self, key: PeerKey, *, handshaking: bool, slot: bool) -> None:
        """Free what a connection held: its handshake slot (starting the queued connections it lets in) and its
        slot under max_connections."""
        if handshaking:
            start, drop = self._admission.handshake_done(key)
            assert self._server is not None
            for sock, _ in drop:
                self._server.shutdown_request(sock)
            for k, (sock, addr), deadline in start:
                self._start(sock, addr, k, deadline)
        if slot:
            self._admission.leave()

    def _connection(self, sock: socket.socket, client_address: Any, key: PeerKey, deadline: float) -> None:
        try:
            self._handle(sock, client_address, key, deadline)
        finally:
            assert self._server is not None
            self._server.shutdown_request(sock)

    def _handle(self, sock: socket.socket, client_address: Any, key: PeerKey, deadline: float) -> None:
        peer = _who(client_address, key)
        handshaking, slot = not key.trusted, key.trusted
        with self._conns_lock:
            self._conns.add(sock)
        try:
            ok = self._authenticate(sock, peer, deadline, handshaking)
            if handshaking:
                handshaking = False
                self._release(key, handshaking=True, slot=False)
                if ok and not self._admission.authenticated():
                    self._refusals.refused(peer, f"authenticated, but {self._max_connections} connections are "
                                                 "already open (max_connections)")
                    ok = False
                slot = ok
            if ok:
                self._serve(sock, peer)
        except (FrameError, OSError) as exc:
            log.debug("store connection from %s ended: %s", peer, exc)
        except Exception:  # noqa: BLE001 - one bad connection must not take the server's thread down loudly
            log.exception("coordination store %s: dropped connection from %s after an internal error", self.url, peer)
        finally:
            with self._conns_lock:
                self._conns.discard(sock)
            self._release(key, handshaking=handshaking, slot=slot)

    def _authenticate(self, sock: socket.socket, peer: str, deadline: float, handshaking: bool) -> bool:
        def refused(reason: str) -> None:
            self._refusals.refused(peer, reason)
        if deadline <= time.monotonic():
            refused("bad handshake (waited past its deadline for a handshake slot)")
            return False
        timeout = self._untrusted_auth_timeout_s if handshaking else self._auth_timeout_s
        if not server_handshake(sock, self._token, refused, timeout_s=timeout, deadline=deadline):
            return False
        sock.settimeout(None)  # authenticated clients may idle in the pool; stop() shuts them down
        return True

    def _serve(self, sock: socket.socket, peer: str) -> None:
        assert self._kv is not None
        while True:
            try:
                req = recv_frame(sock, self._max_frame_bytes, body_timeout_s=self._frame_timeout_s)
            except TimeoutError:
                self._refusals.refused(peer, f"authenticated, but a request frame did not arrive within "
                                             f"{self._frame_timeout_s:g}s of its header; connection closed")
                return
            except PeerClosed:
                raise
            except FrameError as exc:
                self._refusals.refused(peer, f"authenticated, but sent a bad frame ({exc}); connection closed")
                return
            try:
                reply = {"ok": True, **self._kv.apply(req)}
            except (ValueError, StoreError) as exc:
                reply = {"ok": False, "error": str(exc)[:1000]}
            try:
                frame = encode_frame(reply)
            except FrameError as exc:
                frame = encode_frame({"ok": False, "error": f"the reply to {str(req.get('op'))[:20]!r} is too "
                                                            f"large to send ({exc})"})
            sock.settimeout(self._frame_timeout_s)   # a client that stops reading its replies is dropped
            sock.sendall(frame)
            sock.settimeout(None)


class EmbeddedStore(CoordinationStore):
    """Client of `EmbeddedStoreServer`.

    Call order: as `CoordinationStore`. The constructor opens and authenticates one connection, so a
    wrong token (`StoreAuthError`) or dead address (`StoreError`) fails immediately. Thread-safe: each
    call borrows an idle connection or opens a new one, so a thread blocked in `wait` does not hold
    up other threads using the same client. Every socket operation has a timeout; a server that died
    or stopped answering surfaces as `StoreError` naming its address.
    """

    def __init__(self, host: str, port: int, *, token: str, namespace: str, timeout_s: float = 30.0) -> None:
        super().__init__(namespace, f"dp://[{host}]:{port}" if ":" in host else f"dp://{host}:{port}")
        if not token:
            raise ValueError("EmbeddedStore needs the job's token")
        self._addr = (host, port)
        self._token = token.encode()
        self._timeout_s = timeout_s
        self._idle: list[socket.socket] = []
        self._lock = threading.Lock()
        self._closed = False
        self._release(self._open())

    def _open(self) -> socket.socket:
        try:
            sock = socket.create_connection(self._addr, timeout=self._timeout_s)
        except OSError as exc:
            raise StoreError(f"cannot reach the coordination store at {self.where}: {exc}") from exc
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            client_handshake(sock, self._token, self.where, timeout_s=self._timeout_s)
        except BaseException:
            sock.close()
            raise
        return sock

    def _release(self, sock: socket.socket) -> None:
        with self._lock:
            if not self._closed and len(self._idle) < _MAX_IDLE_CONNECTIONS:
                self._idle.append(sock)
                return
        sock.close()

    def _call(self, req: dict[str, Any], reply_timeout_s: float | None = None) -> dict[str, Any]:
        op = req["op"]
        try:
            frame = encode_frame(req)
        except FrameError as exc:
            raise StoreError(f"{op!r} request to the coordination store at {self.where} is too large ({exc}); "
                             "values that large belong in shared memory or storage, not the store") from None
        with self._lock:
            if self._closed:
                raise StoreError(f"store client for {self.where} is closed")
            sock = self._idle.pop() if self._idle else None
        if sock is None:
            sock = self._open()
        timeout = self._timeout_s if reply_timeout_s is None else reply_timeout_s
        started = time.monotonic()
        try:
            # One deadline for the request and its whole reply (not per recv: a trickle cannot stretch it).
            sock.settimeout(timeout)
            sock.sendall(frame)
            reply = recv_frame(sock, deadline=started + timeout)
        except TimeoutError:
            sock.close()
            raise StoreError(f"no reply from the coordination store at {self.where} to {op!r} "
                             f"within {timeout:g}s") from None
        except (OSError, FrameError) as exc:
            sock.close()
            raise StoreError(f"lost the coordination store at {self.where} during {op!r} "
                             f"after {time.monotonic() - started:.2f}s: {exc}") from exc
        except BaseException:
            sock.close()   # e.g. KeyboardInterrupt mid-reply: the connection is out of step, never reuse it
            raise
        self._release(sock)
        if not reply.get("ok"):
            raise StoreError(f"coordination store at {self.where} rejected {op!r}: {reply.get('error')}")
        return reply

    @contextlib.contextmanager
    def _reply_of(self, op: str) -> Iterator[None]:
        """A reply missing its fields (a server that authenticated but misbehaves) is a `StoreError` too."""
        try:
            yield
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise StoreError(f"malformed reply from the coordination store at {self.where} to {op!r}: "
                             f"{str(exc)[:200]}") from None

    def _set(self, key: str, value: bytes) -> None:
        self._call({"op": "set", "key": key, "value": b64(value)})

    def _get(self, key: str) -> bytes | None:
        reply = self._call({"op": "get", "key": key})
        with self._reply_of("get"):
            v = reply["value"]
            return None if v is None else unb64(v, "value")

    def _add(self, key: str, delta: int) -> int:
        reply = self._call({"op": "add", "key": key, "delta": delta})
        with self._reply_of("add"):
            value = reply["value"]
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"counter value {value!r:.50} is not an int")
            return value

    def _compare_set(self, key: str, expected: bytes | None, new: bytes) -> bool:
        reply = self._call({"op": "cas", "key": key, "expected": None if expected is None else b64(expected),
                            "new": b64(new)})
        with self._reply_of("cas"):
            return bool(reply["swapped"])

    def _delete(self, key: str) -> bool:
        reply = self._call({"op": "delete", "key": key})
        with self._reply_of("delete"):
            return bool(reply["deleted"])

    def _items(self, reply: dict[str, Any], op: str) -> dict[str, bytes]:
        with self._reply_of(op):
            items = reply["items"]
            if not isinstance(items, dict):
                raise TypeError("'items' is not an object")
            return {str(k): unb64(v, "value") for k, v in items.items()}

    def _list(self, prefix: str) -> dict[str, bytes]:
        return self._items(self._call({"op": "list", "prefix": prefix}), "list")

    def _wait(self, keys: list[str], timeout_s: float) -> dict[str, bytes]:
        # The server enforces the deadline; the client's deadline adds one op timeout of slack so a dead
        # server still surfaces as StoreError rather than a hang.
        reply = self._call({"op": "wait", "keys": keys, "timeout": timeout_s},
                           reply_timeout_s=timeout_s + self._timeout_s)
        return self._items(reply, "wait")

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for sock in idle:
            sock.close()
