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
renewal was sent, and the store counts from when it arrived). It then pauses its workers (``on_pause``, on the
renewal thread, whatever the main loop is blocked in: SIGSTOP), so by the time its keys vanish and another
launcher reassigns its ranks, nothing of it trains. If a later renewal succeeds, the lease survived (an etcd
that lost quorum cannot expire leases, and its next leader refreshes them): the workers go on (``on_resume``).
If the store says the lease expired, or stays unreachable for ``outage_s``, the host is fenced for good
(``on_lost``: its workers are killed and the launcher leaves).

Call order: ``LeaderElection(store, connect_renewal, host_rank, ttl_s, on_pause=, on_resume=, on_lost=)`` (grants
the lease, writes ``host/<rank>``, starts the renewal thread) -> ``tick()`` every loop turn (returns
:data:`LEADING`, :data:`FOLLOWING`, :data:`PAUSED` or :data:`LOST`; at most two store requests) -> ``close()``
(revokes the lease: the next coordinator takes over at once instead of after ``ttl_s``).
"""
from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from ..store.base import StoreError
from . import keys

log = logging.getLogger("deadpool_ext.launcher")

LEADING, FOLLOWING, PAUSED, LOST = "leading", "following", "paused", "lost"


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
    def __init__(self, store: LeaseStore, connect_renewal: Callable[[float], LeaseStore], host_rank: int,
                 ttl_s: int, *, on_pause: Callable[[str], None], on_resume: Callable[[float], None],
                 on_lost: Callable[[str], None], outage_s: float = 120.0, host: str = "") -> None:
        """``connect_renewal(timeout_s)``: a store connection of its own for the renewal thread, with that request
        timeout (a renewal that hangs must not eat the margin). The callbacks run on that thread:
        ``on_pause(why)`` when the lease can no longer be trusted (it must stop this host's workers from training
        at once: they are paused, not killed, since the store may come back with the lease intact, as after an
        etcd quorum loss); ``on_resume(paused_s)`` when a renewal succeeds again; ``on_lost(why)`` when the store
        says the lease expired (the host's ranks may belong to spares now) or stays unreachable past
        ``outage_s``."""
        if ttl_s < 2:
            raise ValueError(f"leader lease TTL {ttl_s}s: must be at least 2 s")
        self.store, self.host_rank, self.ttl_s, self.outage_s = store, host_rank, ttl_s, outage_s
        self.margin_s = max(0.5, 0.2 * ttl_s)
        self.request_timeout_s = self.margin_s / 2
        self.renew_every_s = ttl_s / 5
        self._renew_store = connect_renewal(self.request_timeout_s)
        self._on_pause, self._on_resume, self._on_lost = on_pause, on_resume, on_lost
        self._me = json.dumps({"host_rank": host_rank, "host": host}).encode()
        sent = time.monotonic()
        self.lease = store.lease_grant(ttl_s)
        self.valid_until = sent + ttl_s - self.margin_s
        store.put_leased(keys.host(host_rank), self._me, self.lease)
        self.leading = False
        self.lost_why = ""
        self.paused_since: float | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._keep, name="deadpool-run-lease", daemon=True)
        self._thread.start()

    def _keep(self) -> None:
        """Renew every ``renew_every_s``; past ``valid_until`` without a renewal, pause; a renewal after that
        resumes; an expired lease, or an outage longer than ``outage_s``, is lost."""
        while not self._stop.is_set():
            now = time.monotonic()
            if self.paused_since is None and now >= self.valid_until:
                self.paused_since = now
                self.leading = False
                self._on_pause(f"no renewal of its lease reached the store for {self.ttl_s - self.margin_s:.1f}s "
                               f"(lease TTL {self.ttl_s}s)")
            if self.paused_since is not None and now - self.paused_since > self.outage_s:
                self._lose(f"the store stayed unreachable for {self.outage_s:g}s (--store-outage-s)")
                return
            try:
                ttl = self._renew_store.lease_keepalive(self.lease)
            except StoreError as exc:
                if self.paused_since is None:
                    log.warning("cannot renew this launcher's lease (%s); it lapses in %.1fs", exc,
                                max(0.0, self.valid_until - time.monotonic()))
                self._stop.wait(min(0.1 if self.paused_since is None else 0.5,
                                    max(0.0, self.valid_until - time.monotonic()) or 0.5))
                continue
            if ttl == 0:
                self._lose(f"the store expired this launcher's lease {self.lease:x}")
                return
            self.valid_until = max(self.valid_until, now + ttl - self.margin_s)
            if self.paused_since is not None:
                paused_s = time.monotonic() - self.paused_since
                self.paused_since = None
                self._on_resume(paused_s)
            self._stop.wait(max(0.0, min(self.renew_every_s, self.valid_until - time.monotonic())))

    def _lose(self, why: str) -> None:
        if self._stop.is_set():
            return
        self.lost_why = why
        self.leading = False
        self._stop.set()
        self._on_lost(why)

    def valid(self) -> bool:
        return not self.lost_why and self.paused_since is None and time.monotonic() < self.valid_until

    def tick(self) -> str:
        """The main loop's turn: :data:`LOST` (expired), :data:`PAUSED` (not renewed in time), or a campaign for
        the coordinator role while this launcher does not hold it."""
        if self.lost_why:
            return LOST
        if not self.valid():
            return PAUSED
        if not self.leading:
            try:
                won = self.store.put_leased(keys.LEADER, self._me, self.lease, create_only=True)
                # still ours after a pause: the key lives under this launcher's lease, which survived
                won = won or self.store.get(keys.LEADER) == self._me
            except StoreError as exc:
                log.debug("leader campaign: %s", exc)
                won = False
            self.leading = won and self.valid()
            if self.leading:
                log.info("host %d holds the coordinator role (lease %x, TTL %ds)", self.host_rank, self.lease,
                         self.ttl_s)
        return LEADING if self.leading else FOLLOWING

    def leader(self) -> dict[str, Any] | None:
        """Who holds the coordinator role now (``{"host_rank", "host"}``), or None (nobody: an election is due)."""
        from .values import BadValue, leader

        raw = self.store.get(keys.LEADER)
        try:
            return leader(keys.LEADER, raw) if raw else None
        except BadValue as exc:
            log.warning("%s", exc)
            return None

    def close(self) -> None:
        if self.lost_why:
            return
        self._stop.set()
        try:
            self.store.lease_revoke(self.lease)
        except StoreError as exc:
            log.debug("lease revoke: %s", exc)
