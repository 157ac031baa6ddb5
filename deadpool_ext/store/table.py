"""The embedded coordination store's table (``store/embedded.py`` serves it): keys to bytes, the ops of the wire
protocol applied one request at a time, waits on a condition variable. No sockets here."""
from __future__ import annotations

import math
import threading
from typing import Any

from deadpool_ext.store.auth import b64, unb64
from deadpool_ext.store.base import parse_counter

__all__ = ["Table"]

_COUNTER_MIN, _COUNTER_MAX = -(1 << 63), (1 << 63) - 1   # add() counters stay 64-bit, as on etcd/c10d


class Table:
    """The server's data: a dict guarded by one condition variable (waiters sleep on it, never spin).

    :meth:`apply` takes one decoded request (``op`` and its fields, as checked here) and returns the reply's
    fields; a malformed request raises ``ValueError`` (the server answers ``{"ok": false, ...}``)."""

    def __init__(self, where: str) -> None:
        self.where = where
        self.data: dict[str, bytes] = {}
        self.cond = threading.Condition()
        self.stopping = False

    def apply(self, req: dict[str, Any]) -> dict[str, Any]:
        op = req.get("op")
        if op == "list":
            prefix = req.get("prefix")
            if not isinstance(prefix, str):
                raise ValueError("list needs a str 'prefix'")
            with self.cond:
                return {"items": {k: b64(v) for k, v in self.data.items() if k.startswith(prefix)}}
        if op == "wait":
            return self._wait(req)
        key = req.get("key")
        if not isinstance(key, str) or not key:
            raise ValueError(f"{str(op)[:20]!r} needs a non-empty str 'key'")
        with self.cond:
            if op == "get":
                v = self.data.get(key)
                return {"value": None if v is None else b64(v)}
            if op == "set":
                self.data[key] = unb64(req.get("value"), "value")
                self.cond.notify_all()
                return {}
            if op == "add":
                delta = req.get("delta")
                if isinstance(delta, bool) or not isinstance(delta, int):
                    raise ValueError("add needs an int 'delta'")
                old = self.data.get(key)
                n = (0 if old is None else parse_counter(old, key, self.where)) + delta
                if not _COUNTER_MIN <= n <= _COUNTER_MAX:
                    raise ValueError(f"add on {key[:200]!r}: the counter would leave the signed 64-bit range")
                self.data[key] = str(n).encode()
                self.cond.notify_all()
                return {"value": n}
            if op == "cas":
                new = unb64(req.get("new"), "new")
                expected = None if req.get("expected") is None else unb64(req.get("expected"), "expected")
                if self.data.get(key) != expected:
                    return {"swapped": False}
                self.data[key] = new
                self.cond.notify_all()
                return {"swapped": True}
            if op == "delete":
                return {"deleted": self.data.pop(key, None) is not None}
        raise ValueError(f"unknown op {str(op)[:20]!r}")

    def _wait(self, req: dict[str, Any]) -> dict[str, Any]:
        keys, timeout = req.get("keys"), req.get("timeout")
        if not isinstance(keys, list) or not keys or not all(isinstance(k, str) and k for k in keys):
            raise ValueError("wait needs a non-empty list of str 'keys'")
        try:
            seconds = float(timeout) if not isinstance(timeout, bool) and isinstance(timeout, (int, float)) else -1.0
        except OverflowError:   # an int too large for a float
            seconds = math.inf
        if not math.isfinite(seconds) or seconds <= 0:
            raise ValueError("wait needs a positive finite 'timeout'")
        seconds = min(seconds, threading.TIMEOUT_MAX)
        with self.cond:
            self.cond.wait_for(lambda: self.stopping or all(k in self.data for k in keys), seconds)
            if self.stopping:
                raise ConnectionAbortedError("server stopping")
            return {"items": {k: b64(self.data[k]) for k in keys if k in self.data}}
