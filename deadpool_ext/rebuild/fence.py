"""Cut the TCP connections of a dead generation, so nobody stays blocked in it.

Why: a gloo collective blocked on a peer only returns when a socket of that peer errors or the group's
timeout expires. A peer that is killed closes its sockets (the kernel does it), but a *survivor* that has
left the generation keeps them open as long as its process-group objects live, and those are kept alive on
purpose (the context's ``graveyard``: gloo's destructor can block). Without this module a survivor still
inside the dead generation waits for the full collective timeout while everyone else waits for it in the
next one.

What: every socket this process opened since the generation started (``begin``), except connections to the
coordination store, belongs to that generation: the c10d store client of the generation and every gloo pair
of every group built on it. ``cut()`` calls ``shutdown(SHUT_RDWR)`` on them (the descriptors stay owned by
gloo, which then sees "connection closed"), which also sends FIN to each peer, so the error cascades to every
process still blocked in the generation within milliseconds.

Who calls it (call order):

1. ``begin(generation)`` just before a generation's process group is created (``rebuild.worker``);
2. ``cut(generation)`` by the survivor's teardown, and by the heartbeat thread as soon as the launcher
   publishes a newer generation (the launcher's notification: a survivor blocked in a collective with a hung
   peer learns of the new generation without waiting for any timeout).

Linux only (``/proc``); elsewhere ``cut`` does nothing and the collective timeout remains the backstop.
"""
from __future__ import annotations

import logging
import os
import socket
import threading

log = logging.getLogger("deadpool_ext")

_LISTEN = "0A"  # TCP state code in /proc/net/tcp


def _tcp_table() -> dict[int, tuple[int, int, str]]:
    """inode -> (local port, remote port, state) for this network namespace's TCP sockets."""
    table: dict[int, tuple[int, int, str]] = {}
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(name) as f:
                lines = f.readlines()[1:]
        except OSError:
            continue
        for line in lines:
            parts = line.split()
            if len(parts) < 10:
                continue
            local, remote, state, inode = parts[1], parts[2], parts[3], int(parts[9])
            table[inode] = (int(local.rsplit(":", 1)[1], 16), int(remote.rsplit(":", 1)[1], 16), state)
    return table


def _socket_fds() -> dict[int, int]:
    """fd -> socket inode for this process."""
    out: dict[int, int] = {}
    try:
        fds = os.listdir("/proc/self/fd")
    except OSError:
        return out
    for fd in fds:
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            out[int(fd)] = int(target[8:-1])
    return out


class GenerationFence:
    """Tracks the sockets of the current generation of this process; see the module docstring."""

    def __init__(self, keep_remote_ports: set[int] | None = None) -> None:
        self.keep_remote_ports = set(keep_remote_ports or ())
        self.generation: int | None = None
        self._baseline: set[int] = set()
        self._cut: set[int] = set()
        self._lock = threading.Lock()

    def begin(self, generation: int) -> None:
        with self._lock:
            self.generation = generation
            self._baseline = set(_socket_fds().values())

    def sockets(self) -> dict[int, int]:
        """fd -> inode of the live TCP connections opened since ``begin`` (store connections excluded)."""
        table = _tcp_table()
        out = {}
        for fd, inode in _socket_fds().items():
            if inode in self._baseline or inode not in table:
                continue
            _, remote, state = table[inode]
            if state == _LISTEN or remote in self.keep_remote_ports:
                continue
            out[fd] = inode
        return out

    def cut(self, generation: int, why: str) -> int:
        """Shut down the sockets of ``generation`` if it is still this process's current one; return how many."""
        with self._lock:
            if self.generation is None or self.generation != generation:
                return 0
            n = 0
            for fd, inode in self.sockets().items():
                if inode in self._cut:
                    continue
                try:
                    if os.readlink(f"/proc/self/fd/{fd}") != f"socket:[{inode}]":
                        continue  # closed and reused meanwhile: not ours any more
                    s = socket.socket(fileno=fd)
                    try:
                        s.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass  # already disconnected
                    finally:
                        s.detach()  # the descriptor stays owned by gloo / the c10d store
                    self._cut.add(inode)
                    n += 1
                except OSError:
                    continue
            if n:
                log.warning("generation %d: cut %d connection(s) of the dead generation (%s)", generation, n, why)
            return n


def fence() -> GenerationFence:
    """This process's fence (``rebuild/context.py``). The membership client adds the coordination store's port to
    ``keep_remote_ports`` (that connection is never cut)."""
    from .context import context

    return context().fence
