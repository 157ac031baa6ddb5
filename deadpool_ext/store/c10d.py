"""A c10d `TCPStore` server that listens only on the address it is given.

Why: ``torch.distributed.TCPStore(host, port, is_master=True)`` ignores `host` for its listening socket and
binds every interface (``::``, dual-stack; checked in /proc/net/tcp6 with torch 2.13, both the libuv and the
legacy server). The c10d store is not authenticated, so on a multi-user or multi-homed machine that hands
the generation's rendezvous to anyone who can reach the port. Here the socket is created and bound in
Python, to `host` only, and handed to the store through ``master_listen_fd``; the store owns the descriptor
from then on (it closes it when the store object is destroyed).

What this does not do: authenticate. Anyone who can reach `host:port` can still read and write the
rendezvous keys (docs/security.md: the c10d store and the gloo/NCCL data plane must be isolated).
Imports torch, so it is kept out of ``deadpool_ext.store``'s ``__init__``.
"""
from __future__ import annotations

import ipaddress
import socket
from datetime import timedelta
from typing import Any

from deadpool_ext.store.base import StoreError, check_timeout

__all__ = ["serve_c10d_store", "bind_listener"]


def _is_wildcard(host: str) -> bool:
    if host in ("", "*"):
        return True
    try:
        return ipaddress.ip_address(host).is_unspecified
    except ValueError:
        return False


def bind_listener(host: str, port: int = 0, *, allow_all_interfaces: bool = False) -> socket.socket:
    """A listening TCP socket bound to `host` (an address or a name resolving to a local address) and `port`
    (0: the kernel picks). Raises ValueError for a wildcard host (unless `allow_all_interfaces`) or a bad
    port, `StoreError` if nothing of `host` can be bound (naming the host and the reasons)."""
    if not isinstance(host, str):
        raise ValueError(f"c10d store host must be a str, got {host!r}")
    if _is_wildcard(host) and not allow_all_interfaces:
        raise ValueError(f"refusing to bind the c10d store to {host!r} (every interface); give the address of the "
                         "interface the job's hosts use (127.0.0.1 on one host)")
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise ValueError(f"c10d store port must be an int in 0..65535, got {port!r}")
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise StoreError(f"cannot bind the c10d store to {host!r}: the name does not resolve ({exc})") from None
    errors: list[str] = []
    for family, socktype, proto, _, addr in infos:
        sock = socket.socket(family, socktype, proto)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)   # a restarted job reuses its port
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.set_inheritable(False)
            sock.bind(addr)
            sock.listen(socket.SOMAXCONN)
            return sock
        except OSError as exc:
            sock.close()
            errors.append(f"{addr[0]}: {exc.strerror or exc}")
    raise StoreError(f"cannot bind the c10d store to {host!r} port {port}: {'; '.join(errors) or 'no address'} "
                     "(the host must be an address of this machine)")


def serve_c10d_store(host: str, world_size: int, *, port: int = 0, timeout_s: float = 300.0,
                     allow_all_interfaces: bool = False) -> tuple[Any, int]:
    """Serve a c10d ``TCPStore`` for `world_size` clients on `host` only; returns ``(store, port)``.

    Keep `store` referenced as long as the store must serve (dropping it closes the port). `port` 0 lets the
    kernel pick at bind time (no probe-then-bind race). Clients connect as usual:
    ``dist.TCPStore(host, port, world_size, is_master=False)``.
    """
    import torch.distributed as dist

    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"c10d store world_size must be a positive int, got {world_size!r}")
    timeout = timedelta(seconds=check_timeout(timeout_s, "c10d store timeout_s"))
    sock = bind_listener(host, port, allow_all_interfaces=allow_all_interfaces)
    bound_port = int(sock.getsockname()[1])
    fd = sock.detach()   # the store owns the descriptor from here on (closing it here too could double-close)
    try:
        store = dist.TCPStore(host, bound_port, world_size, is_master=True, timeout=timeout,
                              wait_for_workers=False, master_listen_fd=fd)
    except (RuntimeError, ValueError) as exc:
        raise StoreError(f"cannot serve the c10d store on {host}:{bound_port}: {' '.join(str(exc).split())[:300]}") \
            from None
    return store, int(store.port)
