"""Listening TCP sockets from /proc/net/tcp{,6}, optionally only a process's own (matched by socket inode).

A plain helper (no test imports), so the subprocesses of tests/security/test_network.py can use it too.
"""
from __future__ import annotations

import os
import socket

_LISTEN = "0A"


def _hex_to_ip(hexaddr: str) -> str:
    raw = bytes.fromhex(hexaddr)
    if len(raw) == 4:
        return socket.inet_ntop(socket.AF_INET, raw[::-1])
    # /proc/net/tcp6: four 32-bit words, each in host (little-endian) order
    return socket.inet_ntop(socket.AF_INET6, b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4)))


def listeners(pid: int | None = None, port: int | None = None) -> list[tuple[str, int]]:
    """(address, port) of listening TCP sockets: those of process `pid` (its fds), and/or on `port`."""
    inodes: set[str] | None = None
    if pid is not None:
        inodes = set()
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if link.startswith("socket:["):
                inodes.add(link[8:-1])
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as fh:
            for line in fh.read().splitlines()[1:]:
                f = line.split()
                if f[3] != _LISTEN or (inodes is not None and f[9] not in inodes):
                    continue
                addr, hexport = f[1].split(":")
                if port is not None and int(hexport, 16) != port:
                    continue
                out.append((_hex_to_ip(addr), int(hexport, 16)))
    return out
