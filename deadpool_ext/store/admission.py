"""Who gets a connection slot of the embedded store, decided before anything is read from the peer.

Why: connections that have not authenticated used to share one pool of `max_connections` with the job's own
clients, so a local user without the token could hold every slot with silent connections (re-opening each one
the handshake deadline dropped) and lock the job out of its own store. Now:

* a peer on this host whose socket belongs to the job's own uid (asked of the kernel's socket table, netlink
  sock_diag: one lookup per connection; that uid can read the token anyway) is **trusted**: its connections count
  against `max_connections` as before;
* every other peer (another uid on this host, another host) is **untrusted** until its handshake succeeds. Its
  connections are handshaken in a small separate pool (`max_pending` at once, `max_pending_per_peer` per peer:
  an address, plus the uid on this host); beyond those a connection waits in its peer's queue (bounded, no thread)
  or is refused at once. A waiting connection's handshake deadline runs from its accept, so a queue never holds
  one longer than `auth_timeout_s`;
* an untrusted connection that authenticates takes a slot under `max_connections` like a trusted one.

So a flood from one uid or one address occupies its own budget only: other peers' handshakes start at once, and
the job's own clients never wait on it. Pure bookkeeping below (`Admission`), unit-tested without sockets; the
server (``embedded.py``) does the I/O.
"""
from __future__ import annotations

import ipaddress
import os
import socket
import struct
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Admission", "PeerKey", "peer_key", "loopback_uid"]

DEFAULT_MAX_PENDING = 64
DEFAULT_MAX_PENDING_PER_PEER = 8
DEFAULT_MAX_QUEUED_PER_PEER = 64
DEFAULT_MAX_QUEUED = 256


@dataclass(frozen=True, slots=True)
class PeerKey:
    """Whose connection this is: an address, and on this host the uid owning the peer's socket (None: unknown)."""

    address: str
    uid: int | None = None
    trusted: bool = False

    def __str__(self) -> str:
        return self.address if self.uid is None else f"{self.address} (uid {self.uid})"


_SOCK_DIAG_BY_FAMILY = 20
_NLMSG_ERROR = 2
_NETLINK_SOCK_DIAG = 4
_NOCOOKIE = 0xFFFFFFFF
_UID_AT = 16 + 4 + 48 + 12   # nlmsghdr, family/state/timer/retrans, inet_diag_sockid, expires/rqueue/wqueue


def _sock_diag_uid(family: int, src: tuple[str, int], dst: tuple[str, int]) -> int | None:
    """The uid of the TCP socket whose own end is `src` and whose peer is `dst`: one exact lookup in the kernel's
    socket table (netlink sock_diag, unprivileged), whatever the number of sockets on the host."""
    packed = [socket.inet_pton(family, a).ljust(16, b"\0") for a in (src[0], dst[0])]
    sockid = struct.pack(">HH16s16s", src[1], dst[1], *packed) + struct.pack("=III", 0, _NOCOOKIE, _NOCOOKIE)
    req = struct.pack("=BBBxI", family, socket.IPPROTO_TCP, 0, 0xFFFFFFFF) + sockid
    msg = struct.pack("=IHHII", 16 + len(req), _SOCK_DIAG_BY_FAMILY, 1, 1, 0) + req   # NLM_F_REQUEST
    with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, _NETLINK_SOCK_DIAG) as nl:
        nl.settimeout(1.0)
        nl.sendto(msg, (0, 0))
        reply = nl.recv(8192)
    if len(reply) < _UID_AT + 4:
        return None
    _, mtype, _, _, _ = struct.unpack_from("=IHHII", reply)
    if mtype != _SOCK_DIAG_BY_FAMILY:   # NLMSG_ERROR: no such socket (gone already)
        return None
    return int(struct.unpack_from("=I", reply, _UID_AT)[0])


def loopback_uid(peer: tuple[Any, ...], local: tuple[Any, ...]) -> int | None:
    """The uid owning the client end of a TCP connection made on this host, or None (not found: gone already,
    another network namespace, no sock_diag)."""
    try:
        ip = ipaddress.ip_address(str(peer[0]).split("%", 1)[0])
        family = socket.AF_INET6 if ip.version == 6 else socket.AF_INET
        return _sock_diag_uid(family, (str(ip), int(peer[1])),
                              (str(local[0]).split("%", 1)[0], int(local[1])))
    except (OSError, ValueError, IndexError, struct.error):
        return None


def peer_key(sock: socket.socket, client_address: Any, own_uid: int | None = None) -> PeerKey:
    """The key a connection is counted under: trusted if the peer is on this host and its socket belongs to
    `own_uid` (default: this process's effective uid)."""
    own = os.geteuid() if own_uid is None else own_uid
    try:
        ip = str(client_address[0])
        addr = ipaddress.ip_address(ip.split("%", 1)[0])
    except (TypeError, IndexError, ValueError):
        return PeerKey(repr(client_address)[:80])
    mapped = getattr(addr, "ipv4_mapped", None)
    local_host = addr.is_loopback or (mapped is not None and mapped.is_loopback)
    if not local_host:
        try:
            local_host = ip == sock.getsockname()[0]   # a connection from this host to its own address
        except OSError:
            local_host = False
    if not local_host:
        return PeerKey(str(addr))
    try:
        uid = loopback_uid(sock.getpeername(), sock.getsockname())
    except OSError:
        uid = None
    return PeerKey(str(addr), uid, trusted=uid is not None and uid == own)


RUN, QUEUE, REFUSE = "run", "queue", "refuse"


@dataclass(slots=True)
class _Waiting:
    item: Any
    deadline: float


@dataclass(slots=True)
class Admission:
    """The slot bookkeeping (thread-safe). Call order per connection: `arrive` (on accept) -> for untrusted ones
    `handshake_done` (returns queued connections to start now) -> `authenticated` (a slot under max_connections,
    or False: refused) -> `leave` when the connection ends (if it held a slot). `expired` is called now and then
    to close queued connections whose deadline passed."""

    max_connections: int
    max_pending: int = DEFAULT_MAX_PENDING
    max_pending_per_peer: int = DEFAULT_MAX_PENDING_PER_PEER
    max_queued_per_peer: int = DEFAULT_MAX_QUEUED_PER_PEER
    max_queued: int = DEFAULT_MAX_QUEUED
    active: int = 0
    pending: dict[PeerKey, int] = field(default_factory=dict)
    queued: dict[PeerKey, deque[_Waiting]] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def pending_total(self) -> int:
        return sum(self.pending.values())

    @property
    def queued_total(self) -> int:
        return sum(len(q) for q in self.queued.values())

    def arrive(self, key: PeerKey, item: Any, deadline: float) -> tuple[str, str]:
        """``(RUN | QUEUE | REFUSE, why)`` for a new connection (`item` is kept if queued)."""
        with self._lock:
            if key.trusted:
                if self.active >= self.max_connections:
                    return REFUSE, f"{self.max_connections} connections already open (max_connections)"
                self.active += 1
                return RUN, ""
            mine = self.pending.get(key, 0)
            if mine < self.max_pending_per_peer and self.pending_total < self.max_pending:
                self.pending[key] = mine + 1
                return RUN, ""
            waiting = self.queued.setdefault(key, deque())
            if len(waiting) < self.max_queued_per_peer and self.queued_total < self.max_queued:
                waiting.append(_Waiting(item, deadline))
                return QUEUE, ""
            if not waiting:
                del self.queued[key]
            return REFUSE, (f"{mine} handshakes of this peer in progress and {len(waiting)} waiting "
                            f"(max_pending_per_peer {self.max_pending_per_peer}, at most "
                            f"{self.max_queued_per_peer} waiting; {self.pending_total} of max_pending "
                            f"{self.max_pending} in progress in all)")

    def handshake_done(self, key: PeerKey) -> tuple[list[tuple[PeerKey, Any, float]], list[Any]]:
        """An untrusted handshake ended (either way): its pending slot is free. Returns ``(start, drop)``: the
        queued connections (this peer's first, then any peer's) that start their handshake now, as ``(key, item,
        deadline)``, and the ones found expired (the caller closes them)."""
        now = time.monotonic()
        start: list[tuple[PeerKey, Any, float]] = []
        drop: list[Any] = []
        with self._lock:
            left = self.pending.get(key, 0) - 1
            if left > 0:
                self.pending[key] = left
            else:
                self.pending.pop(key, None)
            for k in [key, *[k for k in self.queued if k != key]]:
                waiting = self.queued.get(k)
                while waiting and self.pending.get(k, 0) < self.max_pending_per_peer \
                        and self.pending_total < self.max_pending:
                    w = waiting.popleft()
                    if w.deadline <= now:
                        drop.append(w.item)
                        continue
                    self.pending[k] = self.pending.get(k, 0) + 1
                    start.append((k, w.item, w.deadline))
                if waiting is not None and not waiting:
                    del self.queued[k]
        return start, drop

    def authenticated(self) -> bool:
        """An untrusted connection proved the token: a slot under max_connections, if one is free."""
        with self._lock:
            if self.active >= self.max_connections:
                return False
            self.active += 1
            return True

    def leave(self) -> None:
        with self._lock:
            self.active -= 1

    def expired(self, now: float | None = None) -> list[Any]:
        """Queued connections whose handshake deadline passed while they waited (removed; the caller closes them)."""
        now = time.monotonic() if now is None else now
        out: list[Any] = []
        with self._lock:
            for k in list(self.queued):
                waiting = self.queued[k]
                keep = deque(w for w in waiting if w.deadline > now)
                out.extend(w.item for w in waiting if w.deadline <= now)
                if keep:
                    self.queued[k] = keep
                else:
                    del self.queued[k]
        return out
