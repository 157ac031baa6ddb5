"""Which network interface gloo listens on: the one this host uses to reach the job's master address.

Why: gloo's connections are not authenticated. Left alone, torch's ProcessGroupGloo builds its device from
the machine's host name (``createDefaultDevice``: the address the host name resolves to), so a job whose
MASTER_ADDR is 127.0.0.1 may still accept gloo connections on the host's cluster or public address, where
any machine that can route to it can connect. torch 2.13's Python API ignores gloo options in
``init_process_group``/``new_group``, and reads ``GLOO_SOCKET_IFNAME`` (comma-separated interface names)
each time it creates a gloo group, so setting that variable before the first group pins every group of the
process, the snapshot side groups included.

The interface is the one holding the source address the kernel would use towards MASTER_ADDR (a UDP
``connect``, which sends nothing): loopback for a one-host job, the cluster interface otherwise. A value
the user already set is kept (their explicit choice) and logged.

Linux only (``getifaddrs`` through ctypes); pure standard library, no torch.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import ipaddress
import logging
import os
import socket

__all__ = ["GLOO_IFNAME_ENV", "InterfaceError", "local_addresses", "route_source", "interface_for",
           "pin_gloo_interface"]

log = logging.getLogger("deadpool_ext")

GLOO_IFNAME_ENV = "GLOO_SOCKET_IFNAME"


class InterfaceError(ValueError):
    """No local interface can be chosen for the given address (message names the address and the way out)."""


class _Sockaddr(ctypes.Structure):
    _fields_ = [("sa_family", ctypes.c_ushort), ("sa_data", ctypes.c_ubyte * 14)]


class _Ifaddrs(ctypes.Structure):
    pass


_Ifaddrs._fields_ = [
    ("ifa_next", ctypes.POINTER(_Ifaddrs)), ("ifa_name", ctypes.c_char_p), ("ifa_flags", ctypes.c_uint),
    ("ifa_addr", ctypes.POINTER(_Sockaddr)), ("ifa_netmask", ctypes.POINTER(_Sockaddr)),
    ("ifa_ifu", ctypes.POINTER(_Sockaddr)), ("ifa_data", ctypes.c_void_p),
]


def local_addresses() -> list[tuple[str, str]]:
    """(interface name, address) for every IPv4/IPv6 address of this host, in getifaddrs order."""
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    head = ctypes.POINTER(_Ifaddrs)()
    if libc.getifaddrs(ctypes.byref(head)) != 0:
        err = ctypes.get_errno()
        raise InterfaceError(f"cannot list this host's network interfaces: getifaddrs: {os.strerror(err)}")
    out: list[tuple[str, str]] = []
    try:
        node = head
        while node:
            ifa = node.contents
            if ifa.ifa_addr and ifa.ifa_name:
                family = ifa.ifa_addr.contents.sa_family
                if family == socket.AF_INET:
                    raw = ctypes.string_at(ifa.ifa_addr, 8)
                    out.append((ifa.ifa_name.decode(errors="replace"), socket.inet_ntop(socket.AF_INET, raw[4:8])))
                elif family == socket.AF_INET6:
                    raw = ctypes.string_at(ifa.ifa_addr, 24)
                    out.append((ifa.ifa_name.decode(errors="replace"), socket.inet_ntop(socket.AF_INET6, raw[8:24])))
            node = ifa.ifa_next
    finally:
        libc.freeifaddrs(head)
    return out


def route_source(addr: str) -> str:
    """The local address the kernel uses to reach `addr` (resolved first if it is a name); nothing is sent."""
    try:
        infos = socket.getaddrinfo(addr, 9, type=socket.SOCK_DGRAM)
    except socket.gaierror as exc:
        raise InterfaceError(f"master address {addr!r} does not resolve ({exc}); set {GLOO_IFNAME_ENV} to the "
                             "interface gloo should listen on") from None
    errors = []
    for family, socktype, proto, _, sockaddr in infos:
        with socket.socket(family, socktype, proto) as s:
            try:
                s.connect(sockaddr)
                return str(s.getsockname()[0])
            except OSError as exc:
                errors.append(f"{sockaddr[0]}: {exc.strerror or exc}")
    raise InterfaceError(f"no route from this host to master address {addr!r} ({'; '.join(errors)}); set "
                         f"{GLOO_IFNAME_ENV} to the interface gloo should listen on")


def interface_for(addr: str) -> str:
    """The name of the local interface through which this host reaches `addr` (e.g. ``lo`` for 127.0.0.1)."""
    source = ipaddress.ip_address(route_source(addr).split("%")[0])
    for name, a in local_addresses():
        if ipaddress.ip_address(a.split("%")[0]) == source:
            return name
    raise InterfaceError(f"the local address {source} (towards master address {addr!r}) is on no interface "
                         f"getifaddrs lists; set {GLOO_IFNAME_ENV} to the interface gloo should listen on")


_pinned: str | None = None   # process-wide, as os.environ is: what this module set there, not the user's


def pin_gloo_interface(master_addr: str) -> str:
    """Make every gloo group this process creates listen on the interface towards `master_addr`.

    Call before the first process group. Returns the interface name. Keeps a ``GLOO_SOCKET_IFNAME`` the
    user set. Raises `InterfaceError` (one line naming the address) if no interface can be chosen.
    """
    global _pinned
    preset = os.environ.get(GLOO_IFNAME_ENV)
    if preset:
        if preset != _pinned:
            log.info("gloo listens on interface(s) %s (%s set in the environment)", preset, GLOO_IFNAME_ENV)
        return preset
    name = interface_for(master_addr)
    os.environ[GLOO_IFNAME_ENV] = _pinned = name
    log.info("gloo pinned to interface %s (the route to master address %s)", name, master_addr)
    return name
