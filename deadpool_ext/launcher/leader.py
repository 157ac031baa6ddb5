"""The coordinator role under an etcd lease: one launcher leads, any other takes over when it is gone.

Every launcher of a job on an etcd store holds one lease of ``ttl_s`` seconds and renews it every ``ttl_s / 5``.
Two keys live under it:

- ``host/<host_rank>``: this launcher is alive and in contact with the store. It vanishes when the lease expires
  (the host was lost, or cut off from the store), which the coordinator reads as "that host's workers are gone".
- ``leader``: written only if absent (an etcd transaction on the key's create revision), so exactly one launcher
  holds it; the holder is the coordinator (detection, fencing, assignments). When it is lost, its lease expires
  within ``ttl_s``, the key vanishes and the next launcher's campaign wins.

The rule that makes a partition safe: a launcher that could not renew its lease stops considering itself alive
``margin_s`` *before* the store could expire it (the deadline is counted from the moment the last successful
renewal was sent, and the store counts from when it arrived). It then stops its workers and leaves
(:data:`LOST`), so by the time its keys vanish and another launcher reassigns its ranks, nothing of it trains.

Call order: ``LeaderElection(store, host_rank, ttl_s)`` -> ``tick()`` every loop turn (returns
:data:`LEADING`, :data:`FOLLOWING` or :data:`LOST`; never blocks longer than one store request) -> ``close()``
(revokes the lease: the next coordinator takes over at once instead of after ``ttl_s``).
"""
from __future__ import annotations

import json
import logging
import time
from typing import Any, Protocol

from ..store.base import StoreError

log = logging.getLogger("deadpool_ext.launcher")

LEADING, FOLLOWING, LOST = "leading", "following", "lost"


class LeaseStore(Protocol):
    """What an election needs of a store (etcd: :class:`deadpool_ext.store.etcd.EtcdStore`)."""

    def lease_grant(self, ttl_s: int) -> int: ...
    def lease_keepalive(self, lease: int) -> int: ...
    def lease_revoke(self, lease: int) -> None: ...
    def put_leased(self, key: str, value: bytes, lease: int, *, create_only: bool = False) -> bool: ...
    def get(self, key: str) -> bytes | None: ...


def supports_leases(store: Any) -> bool:
    return all(callable(getattr(store, m, None)) for m in ("lease_grant", "lease_keepalive", "put_leased"))


class LeaderElection:
    def __init__(self, store: LeaseStore, host_rank: int, ttl_s: int, *, host: str = "") -> None:
        if ttl_s < 2:
            raise ValueError(f"leader lease TTL {ttl_s}s: must be at least 2 s")
        self.store, self.host_rank, self.ttl_s = store, host_rank, ttl_s
        self.margin_s = max(0.5, 0.2 * ttl_s)
        self.renew_every_s = ttl_s / 5
        self._me = json.dumps({"host_rank": host_rank, "host": host}).encode()
        sent = time.monotonic()
        self.lease = store.lease_grant(ttl_s)
        self.valid_until = sent + ttl_s - self.margin_s
        self._next_renew = sent + self.renew_every_s
        store.put_leased(f"host/{host_rank}", self._me, self.lease)
        self.leading = False
        self.lost_why = ""

    def tick(self) -> str:
        if self.lost_why:
            return LOST
        now = time.monotonic()
        if now >= self._next_renew:
            try:
                ttl = self.store.lease_keepalive(self.lease)
            except StoreError as exc:
                log.warning("cannot renew this launcher's lease (%s); it lapses in %.1fs", exc,
                            max(0.0, self.valid_until - time.monotonic()))
                ttl = -1
            if ttl == 0:
                return self._lose(f"the store expired this launcher's lease {self.lease:x}")
            if ttl > 0:
                self.valid_until = now + ttl - self.margin_s
                self._next_renew = now + self.renew_every_s
            else:
                self._next_renew = now + min(self.renew_every_s, 0.5)
        if time.monotonic() >= self.valid_until:
            return self._lose(f"no renewal of its lease reached the store for {self.ttl_s - self.margin_s:.1f}s "
                              f"(lease TTL {self.ttl_s}s)")
        if not self.leading:
            try:
                self.leading = self.store.put_leased("leader", self._me, self.lease, create_only=True)
            except StoreError as exc:
                log.debug("leader campaign: %s", exc)
            if self.leading:
                log.info("host %d holds the coordinator role (lease %x, TTL %ds)", self.host_rank, self.lease,
                         self.ttl_s)
        return LEADING if self.leading else FOLLOWING

    def _lose(self, why: str) -> str:
        self.lost_why = why
        self.leading = False
        return LOST

    def leader(self) -> dict[str, Any] | None:
        """Who holds the coordinator role now (``{"host_rank", "host"}``), or None (nobody: an election is due)."""
        raw = self.store.get("leader")
        return json.loads(raw) if raw else None

    def close(self) -> None:
        if self.lost_why:
            return
        try:
            self.store.lease_revoke(self.lease)
        except StoreError as exc:
            log.debug("lease revoke: %s", exc)
