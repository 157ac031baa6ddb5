"""The coordination store interface every backend implements, its errors, and `connect`.

The launcher, the spares and every rank meet in one small key/value store: who is alive, which spare
replaces which rank, which snapshot version everyone agreed on. Two backends sit behind the one
interface: the embedded store (served by the launcher itself; nothing to install) and etcd (for jobs
spanning many hosts, where the store must outlive the launcher's host). Callers only ever see
`CoordinationStore`, so moving a job from one to the other is a URL change.

Rules every backend keeps, so callers can rely on them:

* Values are raw ``bytes``; keys are non-empty ``str``. Nothing is pickled: a peer that can write to
  the store must not be able to make a reader execute code. `set_json` / `get_json` are the helpers
  for structured values.
* Every key lives under ``/deadpool/<namespace>/``, so two jobs sharing one etcd cannot see or clobber
  each other's keys. Keys passed in and returned (`list`) are relative to that prefix.
* Joining needs the job's token; a wrong one raises `StoreAuthError` when the store is constructed.
* Nothing blocks forever: every network call has a timeout, `wait` has a mandatory deadline, and
  running out of time raises an error that names what was waited for and where.
"""
from __future__ import annotations

import abc
import builtins
import json
import math
import re
from typing import Any
from urllib.parse import urlsplit

__all__ = [
    "StoreError", "StoreAuthError", "StoreTimeout", "CoordinationStore", "ALLOWED_SCHEMES",
    "parse_store_url", "parse_store_endpoints",
]

ALLOWED_SCHEMES = ("dp", "etcd")
_NAMESPACE_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_ROOT = "/deadpool/"


class StoreError(RuntimeError):
    """The store could not do what was asked: unreachable, connection lost, protocol or server error."""


class StoreAuthError(StoreError):
    """The store refused this process's token (or could not prove it knows the token itself)."""


class StoreTimeout(StoreError, TimeoutError):
    """`CoordinationStore.wait` reached its deadline before all keys existed.

    Carries the keys asked for, the ones still missing and the deadline, so the caller's log says
    exactly which peer never showed up.
    """

    def __init__(self, keys: list[str], missing: list[str], timeout_s: float, namespace: str, where: str) -> None:
        self.keys = list(keys)
        self.missing = list(missing)
        self.timeout_s = timeout_s
        super().__init__(
            f"timed out after {timeout_s:g}s waiting for keys {self.missing} (of {self.keys}) "
            f"in namespace {namespace!r} at {where}")


def _check_key(key: str, what: str = "key") -> None:
    if not isinstance(key, str) or not key:
        raise ValueError(f"store {what} must be a non-empty str, got {key!r}")
    if "\x00" in key:
        raise ValueError(f"store {what} must not contain NUL: {key!r}")


def _check_value(value: bytes) -> None:
    if not isinstance(value, (bytes, bytearray, memoryview)):
        raise TypeError(f"store values are bytes, got {type(value).__name__} (use set_json for structured data)")


def check_timeout(timeout_s: float, what: str) -> float:
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) \
            or not math.isfinite(timeout_s) or timeout_s <= 0:
        raise ValueError(f"{what} must be a positive finite number of seconds, got {timeout_s!r}")
    return float(timeout_s)


class CoordinationStore(abc.ABC):
    """A namespaced key/value store shared by the launcher, spares and ranks of one job.

    Call order: construct (a backend connects and authenticates in its constructor, so a wrong
    token or a dead address fails right there) -> any of `set` / `get` / `add` / `compare_set` /
    `delete` / `list` / `wait`, from any number of threads -> `close()` once. Using a closed store
    raises `StoreError`.

    Subclasses implement the underscored methods on *full* keys (prefix included); the public
    methods here validate arguments and add/strip the namespace prefix, so every backend gets the
    same checks and the same error messages.
    """

    def __init__(self, namespace: str, where: str) -> None:
        if not isinstance(namespace, str) or not _NAMESPACE_RE.match(namespace):
            raise ValueError(f"store namespace must match {_NAMESPACE_RE.pattern} (e.g. the job id), got {namespace!r}")
        self.namespace = namespace
        self.where = where
        self._prefix = f"{_ROOT}{namespace}/"

    # -- public API -------------------------------------------------------------------------------
    def set(self, key: str, value: bytes) -> None:
        """Store `value` under `key`, replacing any previous value; wakes waiters on `key`."""
        _check_key(key)
        _check_value(value)
        self._set(self._prefix + key, bytes(value))

    def get(self, key: str) -> bytes | None:
        """The value of `key`, or None if it does not exist (absence is an answer, not an error)."""
        _check_key(key)
        return self._get(self._prefix + key)

    def add(self, key: str, delta: int) -> int:
        """Atomically add `delta` to the integer counter at `key` (missing = 0) and return the new value.

        Counters are stored as ASCII decimal bytes (``b"42"``) so `get` reads them on any backend;
        adding to a key holding anything else raises `StoreError`.
        """
        _check_key(key)
        if isinstance(delta, bool) or not isinstance(delta, int):
            raise TypeError(f"add() delta must be an int, got {delta!r}")
        return self._add(self._prefix + key, delta)

    def compare_set(self, key: str, expected: bytes | None, new: bytes) -> bool:
        """Atomically set `key` to `new` iff its value is `expected` (None: iff the key does not exist).

        Returns whether the swap happened; exactly one of several racing callers wins.
        """
        _check_key(key)
        if expected is not None:
            _check_value(expected)
            expected = bytes(expected)
        _check_value(new)
        return self._compare_set(self._prefix + key, expected, bytes(new))

    def delete(self, key: str) -> bool:
        """Remove `key`; returns whether it existed."""
        _check_key(key)
        return self._delete(self._prefix + key)

    def list(self, prefix: str = "") -> dict[str, bytes]:
        """All keys starting with `prefix` (relative to the namespace) and their values."""
        if not isinstance(prefix, str):
            raise ValueError(f"list() prefix must be a str, got {prefix!r}")
        n = len(self._prefix)
        return {k[n:]: v for k, v in self._list(self._prefix + prefix).items()}

    def wait(self, keys: builtins.list[str], timeout_s: float) -> dict[str, bytes]:  # `list` is a method here
        """Block until every key in `keys` exists and return their values.

        The deadline is mandatory (no silent hang): past `timeout_s` seconds this raises
        `StoreTimeout` naming the keys still missing.
        """
        if isinstance(keys, str):
            raise TypeError("wait() takes a list of keys, not a single str")
        keys = list(keys)
        if not keys:
            raise ValueError("wait() needs at least one key")
        for k in keys:
            _check_key(k)
        timeout_s = check_timeout(timeout_s, "wait() timeout_s")
        full = [self._prefix + k for k in keys]
        found = self._wait(full, timeout_s)
        missing = [k for k, f in zip(keys, full) if f not in found]
        if missing:
            raise StoreTimeout(keys, missing, timeout_s, self.namespace, self.where)
        return {k: found[f] for k, f in zip(keys, full)}

    def set_json(self, key: str, obj: Any) -> None:
        """`set` of a JSON document (UTF-8); the structured-value path, instead of pickle."""
        self.set(key, json.dumps(obj, separators=(",", ":"), sort_keys=True).encode())

    def get_json(self, key: str) -> Any:
        """`get` + JSON decode; None if the key is missing. Undecodable data raises `StoreError`."""
        raw = self.get(key)
        if raw is None:
            return None
        try:
            return json.loads(raw.decode())
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise StoreError(f"value of {key!r} in namespace {self.namespace!r} at {self.where} is not JSON: {exc}") \
                from exc

    def __enter__(self) -> CoordinationStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.where!r}, namespace={self.namespace!r})"

    # -- backend hooks ----------------------------------------------------------------------------
    @abc.abstractmethod
    def _set(self, key: str, value: bytes) -> None: ...

    @abc.abstractmethod
    def _get(self, key: str) -> bytes | None: ...

    @abc.abstractmethod
    def _add(self, key: str, delta: int) -> int: ...

    @abc.abstractmethod
    def _compare_set(self, key: str, expected: bytes | None, new: bytes) -> bool: ...

    @abc.abstractmethod
    def _delete(self, key: str) -> bool: ...

    @abc.abstractmethod
    def _list(self, prefix: str) -> dict[str, bytes]: ...

    @abc.abstractmethod
    def _wait(self, keys: builtins.list[str], timeout_s: float) -> dict[str, bytes]:
        """Return the subset of `keys` present when all exist or when `timeout_s` ran out."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release connections; idempotent."""


def parse_counter(raw: bytes, key: str, where: str) -> int:
    """Decode a counter value written by `add`; shared so both backends give the same error."""
    try:
        return int(raw.decode("ascii"))
    except (UnicodeDecodeError, ValueError):
        raise StoreError(f"add() on {key!r} at {where}: existing value {raw[:32]!r} is not an integer counter") \
            from None


def rendezvous_prefix(generation: int) -> str:
    """The prefix of generation `generation`'s rendezvous keys (``store/rendezvous.py``: the c10d keys torch
    writes while building that generation's process groups)."""
    return f"rdzv/gen{int(generation)}/"


MAX_ENDPOINTS = 16
"""Most endpoints one store URL may list (an etcd cluster's members)."""


def parse_store_endpoints(url: str) -> tuple[str, list[tuple[str, int]]]:
    """Split ``dp://host:port`` / ``etcd://host:port[,host:port...]`` into (scheme, [(host, port), ...]) with clear
    errors. Only etcd takes several endpoints (the members of one cluster; a client fails over between them)."""
    if not isinstance(url, str):
        raise ValueError(f"store URL must be a str, got {url!r}")
    allowed = "dp://host:port, etcd://host:port[,host:port...]"
    scheme, sep, rest = url.partition("://")
    if not sep or scheme not in ALLOWED_SCHEMES:
        raise ValueError(f"unknown coordination store URL scheme {scheme!r} in {url!r}; allowed: {allowed}")
    members = rest.rstrip("/").split(",")
    if scheme == "dp" and len(members) > 1:
        raise ValueError(f"store URL {url!r}: the embedded store (dp://) has one endpoint; several endpoints are for "
                         "the members of an etcd cluster (etcd://host:port,host:port,...)")
    if len(members) > MAX_ENDPOINTS:
        raise ValueError(f"store URL {url!r}: {len(members)} endpoints, at most {MAX_ENDPOINTS}")
    out: list[tuple[str, int]] = []
    for member in members:
        parts = urlsplit(f"{scheme}://{member}")
        try:
            port = parts.port
        except ValueError as exc:
            raise ValueError(f"bad port in store URL {url!r} ({member!r}): {exc}") from None
        if not parts.hostname or port is None or port == 0 or parts.path or parts.query or parts.fragment \
                or parts.username is not None:
            raise ValueError(f"store URL must look like {allowed}; got {url!r}")
        if (parts.hostname, port) in out:
            raise ValueError(f"store URL {url!r}: endpoint {member!r} is listed twice")
        out.append((parts.hostname, port))
    return scheme, out


def parse_store_url(url: str) -> tuple[str, str, int]:
    """Split ``dp://host:port`` / ``etcd://host:port`` into (scheme, host, port) with clear errors; for an etcd
    URL listing several members, the first (see :func:`parse_store_endpoints`)."""
    scheme, endpoints = parse_store_endpoints(url)
    return scheme, endpoints[0][0], endpoints[0][1]
