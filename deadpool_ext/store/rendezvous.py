"""The rendezvous store of a generation's process groups, carried by the job's authenticated coordination store.

Why: torch's c10d ``TCPStore`` has no authentication, so whoever could connect to the per-generation port could
read the generation's keys and write its own (the gloo peers' addresses among them: stall the generation or
make ranks connect to it). `TokenStore` is a ``torch.distributed.Store`` written in Python whose every key lives
in the coordination store the worker already holds: the embedded store's HMAC handshake or etcd's auth, i.e. the
job's token, before any key is read or written. torch calls it like any c10d store (``init_process_group(...,
store=...)``, ``new_group``'s ``PrefixStore``, gloo's and NCCL's address exchange).

Keys: ``rdzv/gen<N>/<c10d key>`` (one prefix per generation: nothing of a dead generation is read). Values are
the bytes torch gives. Blocking semantics as c10d's: `get` and `wait` wait for the key up to the store's timeout
and then raise naming it. Imports torch, so it is kept out of ``deadpool_ext.store``'s ``__init__``.
"""
from __future__ import annotations

import builtins
import time
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from deadpool_ext.store.base import CoordinationStore, StoreTimeout, rendezvous_prefix

__all__ = ["TokenStore", "generation_prefix"]

WAIT_SLICE_S = 1.0
"""A blocked rendezvous read checks this often whether its generation is already over."""


generation_prefix = rendezvous_prefix
_KEEP_ALIVE: list[TokenStore] = []
"""Every TokenStore made: a Python store object must outlive every C++ reference torch holds to it (pybind11 keeps
only the C++ part alive; without its Python part, torch's next call fails "Not implemented"), and torch keeps its
stores as long as their process groups. A few per generation."""


def _bytes(value: Any) -> bytes:
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    if isinstance(value, str):
        return value.encode()
    if isinstance(value, list):   # torch passes std::vector<uint8_t> as a list of ints
        return bytes(value)
    return str(value).encode()


class TokenStore(dist.Store):
    """A c10d store over `store` (a connected, authenticated `CoordinationStore`), under `prefix`.

    Call order: as any c10d store; torch calls it from its own threads (gloo's rendezvous), and the coordination
    store's client is thread-safe. `timeout` bounds `get` and `wait` without an explicit timeout. `dead_key`: a
    key of the coordination store whose appearance means this generation is over (the launcher published the
    next one); a rank waiting in the rendezvous then stops at once instead of at its timeout (the generation
    fence cannot cut these waits: they run over the coordination store's connection, which it keeps)."""

    def __init__(self, store: CoordinationStore, prefix: str, timeout: timedelta, dead_key: str | None = None) -> None:
        super().__init__()
        self._store = store
        self._prefix = prefix
        self._dead_key = dead_key
        self._timeout = timeout
        self.set_timeout(timeout)
        _KEEP_ALIVE.append(self)

    def set_timeout(self, timeout: timedelta) -> None:
        self._timeout = timeout
        super().set_timeout(timeout)

    def _key(self, key: str) -> str:
        return self._prefix + key

    def _seconds(self, timeout: Any = None) -> float:
        t = self._timeout if timeout is None else timeout
        seconds = t.total_seconds() if isinstance(t, timedelta) else float(t)
        return seconds if seconds > 0 else 300.0

    def set(self, key: str, value: Any) -> None:
        self._store.set(self._key(key), _bytes(value))

    def get(self, key: str) -> bytes:
        return self._wait_all([key], self._seconds())[key]

    def add(self, key: str, value: int) -> int:
        return self._store.add(self._key(key), int(value))

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        exp = _bytes(expected)
        self._store.compare_set(self._key(key), exp if exp else None, _bytes(desired))
        current = self._store.get(self._key(key))
        return exp if current is None else current

    def check(self, keys: builtins.list[str]) -> bool:
        return all(self._store.get(self._key(k)) is not None for k in keys)

    def wait(self, keys: builtins.list[str], timeout: Any = None) -> None:
        self._wait_all(list(keys), self._seconds(timeout))

    def delete_key(self, key: str) -> bool:
        return self._store.delete(self._key(key))

    def num_keys(self) -> int:
        return len(self._store.list(self._prefix))

    def clone(self) -> TokenStore:
        """torch's gloo takes a clone of its store; the clone shares this one's client (thread-safe)."""
        return TokenStore(self._store, self._prefix, self._timeout, self._dead_key)

    def has_extended_api(self) -> bool:
        return True

    def multi_get(self, keys: builtins.list[str]) -> builtins.list[bytes]:
        found = self._wait_all(list(keys), self._seconds())
        return [found[k] for k in keys]

    def multi_set(self, keys: builtins.list[str], values: builtins.list[Any]) -> None:
        for k, v in zip(keys, values):
            self.set(k, v)

    def append(self, key: str, value: Any) -> None:
        full, extra = self._key(key), _bytes(value)
        while True:   # compare-and-set until no other rank appended in between
            cur = self._store.get(full)
            if self._store.compare_set(full, cur, (cur or b"") + extra):
                return

    def list_keys(self) -> builtins.list[str]:
        return sorted(self._store.list(self._prefix))

    def _wait_all(self, keys: builtins.list[str], seconds: float) -> dict[str, bytes]:
        full = [self._key(k) for k in keys]
        deadline = time.monotonic() + seconds
        while True:
            left = deadline - time.monotonic()
            try:   # in slices, so that the next generation's notice is seen while waiting
                found = self._store.wait(full, max(0.001, min(left, WAIT_SLICE_S)))
                return {k: found[f] for k, f in zip(keys, full)}
            except StoreTimeout as exc:
                missing = [k[len(self._prefix):] for k in exc.missing]
            if self._dead_key is not None and self._store.get(self._dead_key) is not None:
                raise RuntimeError(f"rendezvous: the generation of {self._prefix!r} was replaced while waiting for "
                                   f"{missing[:4]} ({self._dead_key} is set)")
            if left <= WAIT_SLICE_S:
                raise RuntimeError(f"rendezvous: timed out after {seconds:g}s waiting for {missing[:4]} under "
                                   f"{self._prefix!r} in the job's store ({self._store.where})")
