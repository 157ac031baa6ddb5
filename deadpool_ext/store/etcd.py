"""The etcd coordination store: for jobs spanning many hosts, where the store must outlive any one of them.

Talks to etcd v3's JSON gateway (``POST /v3/kv/...``) with urllib only, so the backend adds no pip
dependency and works with Debian's ``etcd-server`` package. Atomic operations map onto etcd
transactions: `compare_set` is one ``txn`` (compare VALUE, or CREATE revision == 0 for "must not
exist"); `add` is a compare-and-swap loop on the key's ``mod_revision``. `wait` polls all keys in one
``txn`` with a short, growing sleep under the caller's deadline (simpler and more robust through
proxies than the streaming watch endpoint).

Auth is etcd's own: the job token is the password of an etcd user (``root`` by default, set up once
by `bootstrap_etcd_auth`). The constructor exchanges it at ``/v3/auth/authenticate`` for an etcd
session token sent in the ``Authorization`` header; when that expires (``--auth-token-ttl``), the
client re-authenticates once and retries. Note: over plain ``http://`` the password crosses the wire
at authentication, so keep etcd on a trusted network (see docs/store.md).
"""
from __future__ import annotations

import base64
import functools
import http.client
import json
import logging
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from deadpool_ext.store.base import (
    CoordinationStore,
    StoreAuthError,
    StoreError,
    _check_key,
    _check_value,
    parse_counter,
)

__all__ = ["EtcdStore", "bootstrap_etcd_auth"]

log = logging.getLogger("deadpool_ext")

_MAX_TXN_OPS = 128   # etcd's default --max-txn-ops
_MAX_REPLY_BYTES = 256 << 20   # etcd's own request limit is 1.5 MiB; a larger reply is not etcd talking
_POLL_MIN_S, _POLL_MAX_S = 0.01, 0.1
_MEMBER_UNAVAILABLE = ("no leader", "request timed out", "leader changed", "server stopped", "not capable",
                       "too many requests")
"""etcd errors that mean "this member cannot serve now" (another member of the cluster may): fail over."""
_T = TypeVar("_T")


class _EtcdHTTPError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status, self.message = status, message


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _k(key: str) -> str:
    return _b64(key.encode())


def _range_end(prefix: bytes) -> bytes:
    """etcd's "every key starting with prefix" range end: the prefix with its last byte incremented."""
    p = bytearray(prefix)
    while p:
        if p[-1] < 0xFF:
            p[-1] += 1
            return bytes(p)
        p.pop()
    return b"\x00"


def _value(kv: dict[str, Any]) -> bytes:
    return base64.b64decode(kv.get("value", ""), validate=True)   # proto3 JSON omits empty values


def _read_reply(resp: Any, endpoint: str, path: str, deadline: float) -> dict[str, Any]:
    """The body of an etcd reply, read in chunks under one deadline, bounded in size, JSON object or error."""
    body = bytearray()
    while True:
        if time.monotonic() > deadline:
            raise StoreError(f"etcd at {endpoint} ({path}): the reply did not arrive within the request timeout")
        chunk = resp.read(1 << 16)
        if not chunk:
            break
        body += chunk
        if len(body) > _MAX_REPLY_BYTES:
            raise StoreError(f"etcd at {endpoint} ({path}): reply larger than {_MAX_REPLY_BYTES} bytes; not etcd?")
    try:
        out = json.loads(body.decode() or "{}")
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise StoreError(f"etcd at {endpoint} ({path}) answered something that is not JSON: "
                         f"{type(exc).__name__}") from None
    if not isinstance(out, dict):
        raise StoreError(f"etcd at {endpoint} ({path}) answered a JSON {type(out).__name__}, not an object")
    return out


def _opener() -> urllib.request.OpenerDirector:
    # No proxies: an http_proxy in the environment must not route job coordination through a third host.
    return urllib.request.build_opener(urllib.request.ProxyHandler({}))


def _post(opener: urllib.request.OpenerDirector, endpoint: str, path: str, body: dict[str, Any], timeout_s: float,
          auth_token: str | None = None) -> dict[str, Any]:
    headers = {"Content-Type": "application/json"}
    if auth_token is not None:
        headers["Authorization"] = auth_token
    req = urllib.request.Request(endpoint + path, data=json.dumps(body).encode(), headers=headers, method="POST")
    deadline = time.monotonic() + timeout_s
    try:
        with opener.open(req, timeout=timeout_s) as resp:
            return _read_reply(resp, endpoint, path, deadline)
    except urllib.error.HTTPError as exc:
        raw = exc.read(4096).decode(errors="replace")
        try:
            message = json.loads(raw).get("message") or raw
        except (ValueError, AttributeError, RecursionError):
            message = raw
        raise _EtcdHTTPError(exc.code, str(message).strip()) from None
    except (TimeoutError, urllib.error.URLError, OSError, http.client.HTTPException) as exc:
        reason = getattr(exc, "reason", exc)
        raise StoreError(f"cannot reach etcd at {endpoint} ({path}, timeout {timeout_s:g}s): {reason}") from None


def _authenticate(opener: urllib.request.OpenerDirector, endpoint: str, user: str, password: str,
                  timeout_s: float) -> str:
    try:
        reply = _post(opener, endpoint, "/v3/auth/authenticate", {"name": user, "password": password}, timeout_s)
    except _EtcdHTTPError as exc:
        if "not enabled" in exc.message:
            raise StoreAuthError(f"etcd at {endpoint} has authentication disabled, so any process could join; run "
                                 "deadpool_ext.store.etcd.bootstrap_etcd_auth(endpoint, token) once") from None
        log.warning("etcd at %s refused user %r: wrong token for this job (%s)", endpoint, user, exc.message)
        raise StoreAuthError(f"etcd at {endpoint} refused user {user!r}: wrong token for this job "
                             f"({exc.message})") from None
    token = reply.get("token")
    if not isinstance(token, str) or not token:
        raise StoreError(f"etcd at {endpoint} answered /v3/auth/authenticate without a token: {reply}")
    return token


_F = TypeVar("_F", bound=Callable[..., Any])


def _parsed(method: _F) -> _F:
    """A reply without the fields etcd always sends (a proxy or an impostor answering) is a `StoreError`,
    not a KeyError from deep inside a backend method."""
    @functools.wraps(method)
    def wrapper(self: EtcdStore, *args: Any, **kwargs: Any) -> Any:
        try:
            return method(self, *args, **kwargs)
        except (KeyError, IndexError, TypeError, ValueError, AttributeError) as exc:
            raise StoreError(f"malformed reply from etcd at {self.endpoint} to {method.__name__.strip('_')}(): "
                             f"{type(exc).__name__}: {str(exc)[:200]}") from None
    return wrapper  # type: ignore[return-value]


def _check_endpoint(endpoint: str) -> str:
    if not isinstance(endpoint, str) or not endpoint.startswith("http://"):
        raise ValueError(f"etcd endpoint must look like http://host:port, got {endpoint!r}")
    return endpoint.rstrip("/")


class EtcdStore(CoordinationStore):
    """`CoordinationStore` on etcd v3 (tested with Debian's etcd-server 3.4).

    Call order: as `CoordinationStore`. The constructor authenticates as `user` with `token` as the
    password: a wrong token raises `StoreAuthError` (and logs a warning), an unreachable endpoint
    raises `StoreError`. Thread-safe (every call is an independent HTTP request). Every request has
    `timeout_s`.
    """

    def __init__(self, endpoint: str | Sequence[str], *, token: str, namespace: str, timeout_s: float = 30.0,
                 user: str = "root") -> None:
        endpoints = [endpoint] if isinstance(endpoint, str) else list(endpoint)
        if not endpoints:
            raise ValueError("EtcdStore needs at least one endpoint")
        self.endpoints = [_check_endpoint(e) for e in endpoints]
        super().__init__(namespace, ",".join(self.endpoints))
        if not token:
            raise ValueError("EtcdStore needs the job's token")
        self._user, self._password, self._timeout_s = user, token, timeout_s
        self._opener = _opener()
        self._lock = threading.Lock()
        self._closed = False
        self._current = 0
        self._degraded = False   # a member failed since the last request that got through
        self._auth_token = self._on_some_member(
            lambda ep: _authenticate(self._opener, ep, user, token, timeout_s), "/v3/auth/authenticate")

    @property
    def endpoint(self) -> str:
        """The member this client talks to now (it moves to the next one when this one stops answering)."""
        return self.endpoints[self._current]

    def _on_some_member(self, call: Callable[[str], _T], path: str) -> _T:
        """``call(endpoint)`` on the current member; one that cannot be reached, or answers that it has no
        leader, is left for the next one (a cluster survives losing a minority of its members). Every member
        tried once; then the error names all of them."""
        errors: list[str] = []
        for _ in range(len(self.endpoints)):
            with self._lock:
                index = self._current
            ep = self.endpoints[index]
            try:
                result = call(ep)
                if self._degraded:
                    self._degraded = False
                    log.warning("etcd member %s serves %s again", ep, path)
                return result
            except StoreError as exc:
                if isinstance(exc, StoreAuthError):
                    raise
                errors.append(str(exc))
            except _EtcdHTTPError as exc:
                if not any(m in exc.message for m in _MEMBER_UNAVAILABLE):
                    raise
                errors.append(f"etcd at {ep} ({path}): {exc.message}")
            with self._lock:
                if self._current == index:
                    self._current = (index + 1) % len(self.endpoints)
                    if len(self.endpoints) > 1:  # once per outage at warning level, then quietly
                        log.log(logging.DEBUG if self._degraded else logging.WARNING,
                                "etcd member %s did not serve %s (%s); trying %s", ep, path, errors[-1],
                                self.endpoints[self._current])
                        self._degraded = True
        if len(self.endpoints) == 1:
            raise StoreError(errors[-1])
        raise StoreError(f"no member of the etcd cluster served {path}: " + "; ".join(errors))

    def _request(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        for attempt in (0, 1):
            with self._lock:
                if self._closed:
                    raise StoreError(f"store client for {self.where} is closed")
                auth_token = self._auth_token
            try:
                return self._on_some_member(
                    functools.partial(self._post_to, path=path, body=body, auth_token=auth_token), path)
            except _EtcdHTTPError as exc:
                if "invalid auth token" in exc.message and attempt == 0:
                    new = self._on_some_member(lambda ep: _authenticate(self._opener, ep, self._user,
                                                                        self._password, self._timeout_s),
                                               "/v3/auth/authenticate")
                    with self._lock:
                        self._auth_token = new
                    continue
                if "permission denied" in exc.message or "invalid auth token" in exc.message:
                    raise StoreAuthError(f"etcd at {self.endpoint} refused {path} for user {self._user!r}: "
                                         f"{exc.message}") from None
                raise StoreError(f"etcd at {self.endpoint} rejected {path}: {exc.message}") from None
        raise AssertionError("unreachable")

    def _post_to(self, endpoint: str, *, path: str, body: dict[str, Any], auth_token: str) -> dict[str, Any]:
        return _post(self._opener, endpoint, path, body, self._timeout_s, auth_token)

    # -- leases (etcd only: what an election and a host's liveness are built on) ---------------------
    def lease_grant(self, ttl_s: int) -> int:
        """A new lease of ``ttl_s`` seconds; keys written with it vanish when it expires or is revoked."""
        if isinstance(ttl_s, bool) or not isinstance(ttl_s, int) or not 1 <= ttl_s <= 3600:
            raise ValueError(f"lease TTL must be an integer number of seconds in 1..3600, got {ttl_s!r}")
        return self._lease_grant(ttl_s)

    @_parsed
    def _lease_grant(self, ttl_s: int) -> int:
        return int(self._request("/v3/lease/grant", {"TTL": ttl_s})["ID"])

    @_parsed
    def lease_keepalive(self, lease: int) -> int:
        """Renew ``lease``; returns its TTL in seconds from now, 0 if it has expired (or was revoked)."""
        reply = self._request("/v3/lease/keepalive", {"ID": str(lease)})
        if "result" not in reply:  # the stream's error (e.g. "leader changed"): no answer about the lease
            error = reply.get("error")
            raise StoreError(f"etcd at {self.endpoint} did not renew lease {lease:x}: "
                             f"{error.get('message') if isinstance(error, dict) else reply}")
        return int(reply["result"].get("TTL", 0))

    @_parsed
    def lease_revoke(self, lease: int) -> None:
        """End ``lease`` now (its keys vanish); a lease already gone is not an error."""
        try:
            self._request("/v3/lease/revoke", {"ID": str(lease)})
        except StoreError as exc:
            if "lease not found" not in str(exc):
                raise

    @_parsed
    def put_leased(self, key: str, value: bytes, lease: int, *, create_only: bool = False) -> bool:
        """``set`` bound to ``lease`` (the key vanishes with it); ``create_only``: only if ``key`` does not
        exist (an election: exactly one of several racing callers gets True)."""
        _check_key(key)
        _check_value(value)
        full = self._prefix + key
        put = {"request_put": {"key": _k(full), "value": _b64(bytes(value)), "lease": str(lease)}}
        if not create_only:
            self._request("/v3/kv/put", put["request_put"])
            return True
        cmp = {"key": _k(full), "target": "CREATE", "result": "EQUAL", "create_revision": "0"}
        return bool(self._txn([cmp], [put]).get("succeeded"))

    def _txn(self, compare: list[dict[str, Any]], success: list[dict[str, Any]],
             failure: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        return self._request("/v3/kv/txn", {"compare": compare, "success": success, "failure": failure or []})

    def _set(self, key: str, value: bytes) -> None:
        self._request("/v3/kv/put", {"key": _k(key), "value": _b64(value)})

    @_parsed
    def _get(self, key: str) -> bytes | None:
        kvs = self._request("/v3/kv/range", {"key": _k(key)}).get("kvs") or []
        return _value(kvs[0]) if kvs else None

    @_parsed
    def _add(self, key: str, delta: int) -> int:
        # CAS loop: the failure branch returns the current kv, so each retry is one round trip.
        deadline = time.monotonic() + self._timeout_s
        kvs = self._request("/v3/kv/range", {"key": _k(key)}).get("kvs") or []
        while True:
            kv = kvs[0] if kvs else None
            if kv is None:
                new = delta
                cmp = {"key": _k(key), "target": "CREATE", "result": "EQUAL", "create_revision": "0"}
            else:
                new = parse_counter(_value(kv), key, self.endpoint) + delta
                cmp = {"key": _k(key), "target": "MOD", "result": "EQUAL", "mod_revision": kv["mod_revision"]}
            reply = self._txn([cmp], [{"request_put": {"key": _k(key), "value": _b64(str(new).encode())}}],
                              [{"request_range": {"key": _k(key)}}])
            if reply.get("succeeded"):
                return new
            if time.monotonic() > deadline:
                raise StoreError(f"add() on {key!r} at {self.endpoint} lost the compare-and-swap race for "
                                 f"{self._timeout_s:g}s")
            kvs = reply["responses"][0]["response_range"].get("kvs") or []

    @_parsed
    def _compare_set(self, key: str, expected: bytes | None, new: bytes) -> bool:
        if expected is None:
            cmp = {"key": _k(key), "target": "CREATE", "result": "EQUAL", "create_revision": "0"}
        else:
            cmp = {"key": _k(key), "target": "VALUE", "result": "EQUAL", "value": _b64(expected)}
        reply = self._txn([cmp], [{"request_put": {"key": _k(key), "value": _b64(new)}}])
        return bool(reply.get("succeeded"))

    @_parsed
    def _delete(self, key: str) -> bool:
        return int(self._request("/v3/kv/deleterange", {"key": _k(key)}).get("deleted", 0)) > 0

    @_parsed
    def _list(self, prefix: str) -> dict[str, bytes]:
        p = prefix.encode()
        kvs = self._request("/v3/kv/range", {"key": _b64(p), "range_end": _b64(_range_end(p))}).get("kvs") or []
        return {base64.b64decode(kv["key"]).decode(): _value(kv) for kv in kvs}

    @_parsed
    def _present(self, keys: list[str]) -> dict[str, bytes]:
        found: dict[str, bytes] = {}
        for i in range(0, len(keys), _MAX_TXN_OPS):
            chunk = keys[i:i + _MAX_TXN_OPS]
            reply = self._txn([], [{"request_range": {"key": _k(k)}} for k in chunk])
            for k, r in zip(chunk, reply.get("responses", [])):
                kvs = r.get("response_range", {}).get("kvs") or []
                if kvs:
                    found[k] = _value(kvs[0])
        return found

    def _wait(self, keys: list[str], timeout_s: float) -> dict[str, bytes]:
        deadline = time.monotonic() + timeout_s
        pause = _POLL_MIN_S
        while True:
            found = self._present(keys)
            remaining = deadline - time.monotonic()
            if len(found) == len(keys) or remaining <= 0:
                return found
            time.sleep(min(pause, remaining))
            pause = min(pause * 2, _POLL_MAX_S)

    def close(self) -> None:
        with self._lock:
            self._closed = True


def bootstrap_etcd_auth(endpoint: str, token: str, *, timeout_s: float = 30.0) -> bool:
    """Make `token` the password of etcd user ``root`` (with role root) and enable etcd auth.

    ``root`` because etcd refuses to enable auth without a root user; a cluster shared by several jobs
    can add per-job users itself and pass ``user=`` to `EtcdStore`.

    Run once per etcd cluster by the launcher or the test fixture, before any `EtcdStore`. Returns True
    if it enabled auth, False if auth was already enabled and `token` already works (idempotent);
    raises `StoreAuthError` if auth is on with a different password.
    """
    endpoint, user = _check_endpoint(endpoint), "root"
    if not token:
        raise ValueError("bootstrap_etcd_auth needs a non-empty token")
    opener = _opener()

    def call(path: str, body: dict[str, Any], tolerate: str = "") -> None:
        try:
            _post(opener, endpoint, path, body, timeout_s)
        except _EtcdHTTPError as exc:
            if not tolerate or tolerate not in exc.message:
                raise
    try:
        call("/v3/auth/role/add", {"name": "root"}, tolerate="role name already exists")
    except _EtcdHTTPError as exc:
        if "user name is empty" in exc.message or "permission denied" in exc.message:
            _authenticate(opener, endpoint, user, token, timeout_s)   # auth already on: the token must work
            return False
        raise StoreError(f"etcd at {endpoint}: cannot bootstrap auth: {exc.message}") from None
    try:
        try:
            call("/v3/auth/user/add", {"name": user, "password": token})
        except _EtcdHTTPError as exc:
            if "already exists" not in exc.message:
                raise
            call("/v3/auth/user/changepw", {"name": user, "password": token})
        call("/v3/auth/user/grant", {"user": user, "role": "root"})
        call("/v3/auth/enable", {})
    except _EtcdHTTPError as exc:
        raise StoreError(f"etcd at {endpoint}: cannot bootstrap auth: {exc.message}") from None
    log.info("etcd at %s: authentication enabled for user %r", endpoint, user)
    return True
