"""The coordinator election and the lease rules (launcher/leader.py) against an in-memory lease store: exactly one
leader, a lapsed renewal pauses before the store could expire the lease, a renewal that gets through resumes, an
expired lease is lost. No processes; the renewal thread is real."""
from __future__ import annotations

import threading
import time

import pytest

from deadpool_ext.launcher.leader import FOLLOWING, LEADING, LOST, PAUSED, LeaderElection
from deadpool_ext.store.base import StoreError


class FakeLeases:
    """Leases and keys in one process: ``down`` makes every call fail (a partition); ``expire(id)`` ends a lease."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.kv: dict[str, tuple[bytes, int]] = {}
        self.leases: dict[int, int] = {}
        self.next_id = 1
        self.down = False

    def _up(self) -> None:
        if self.down:
            raise StoreError("unreachable")

    def lease_grant(self, ttl_s: int) -> int:
        self._up()
        with self.lock:
            lid, self.next_id = self.next_id, self.next_id + 1
            self.leases[lid] = ttl_s
            return lid

    def lease_keepalive(self, lease: int) -> int:
        self._up()
        with self.lock:
            return self.leases.get(lease, 0)

    def lease_revoke(self, lease: int) -> None:
        self.expire(lease)

    def expire(self, lease: int) -> None:
        with self.lock:
            self.leases.pop(lease, None)
            self.kv = {k: v for k, v in self.kv.items() if v[1] != lease}

    def put_leased(self, key: str, value: bytes, lease: int, *, create_only: bool = False) -> bool:
        self._up()
        with self.lock:
            if create_only and key in self.kv:
                return False
            self.kv[key] = (value, lease)
            return True

    def get(self, key: str) -> bytes | None:
        self._up()
        with self.lock:
            v = self.kv.get(key)
            return v[0] if v else None


def election(store: FakeLeases, rank: int, ttl: int = 2, **kw):
    calls: dict[str, list] = {"pause": [], "resume": [], "lost": []}
    e = LeaderElection(store, lambda _t: store, rank, ttl, on_pause=calls["pause"].append,
                       on_resume=calls["resume"].append, on_lost=calls["lost"].append, **kw)
    return e, calls


def wait_for(cond, timeout=5.0):
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "condition not reached"
        time.sleep(0.01)


def test_exactly_one_leader_and_takeover_when_its_lease_ends():
    store = FakeLeases()
    a, _ = election(store, 0)
    b, _ = election(store, 1)
    assert a.tick() == LEADING and b.tick() == FOLLOWING
    assert store.get("host/0") and store.get("host/1")
    assert b.leader() == {"host_rank": 0, "host": ""}
    store.expire(a.lease)            # host 0 lost: its lease, leader key and host key vanish
    assert store.get("host/0") is None
    assert b.tick() == LEADING
    a.close()
    b.close()


def test_lapsed_renewal_pauses_before_the_ttl_then_resumes():
    store = FakeLeases()
    e, calls = election(store, 0, ttl=2)
    assert e.tick() == LEADING
    store.down = True
    t0 = time.monotonic()
    wait_for(lambda: calls["pause"])
    paused_after = time.monotonic() - t0
    assert paused_after < 2 - e.margin_s + 0.2, "paused before the store could expire the lease"
    assert e.tick() == PAUSED and not e.leading
    store.down = False               # e.g. quorum back, the lease intact
    wait_for(lambda: calls["resume"])
    assert calls["lost"] == []
    assert e.tick() == LEADING, "the leader key is still this launcher's: it leads again"
    e.close()


def test_expired_lease_is_lost():
    store = FakeLeases()
    e, calls = election(store, 1, ttl=2)
    store.down = True
    wait_for(lambda: calls["pause"])
    store.expire(e.lease)            # the others moved on while this host was cut off
    store.down = False
    wait_for(lambda: calls["lost"])
    assert "expired" in calls["lost"][0] and calls["resume"] == []
    assert e.tick() == LOST


def test_outage_longer_than_the_limit_is_lost():
    store = FakeLeases()
    e, calls = election(store, 0, ttl=2, outage_s=0.5)
    store.down = True
    wait_for(lambda: calls["lost"])
    assert "unreachable for 0.5s" in calls["lost"][0]


def test_ttl_below_two_seconds_is_refused():
    with pytest.raises(ValueError, match="at least 2 s"):
        election(FakeLeases(), 0, ttl=1)
