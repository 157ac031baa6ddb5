"""Give the C heap's free memory back to the OS (glibc ``malloc_trim``), after work that freed a lot at once.

An interrupted training step leaves its activations, gathered parameters and gradient buckets to be freed by the
recovery; glibc keeps freed heap memory in its arenas (one per thread that allocated, and every hot-swap starts
new communicator threads), so without this a survivor's resident memory stays at its peak. No-op where glibc is
not the allocator (musl, macOS) or the call is unavailable."""
from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger("deadpool_ext")

_libc: ctypes.CDLL | None | bool = None  # process-wide: the C library loaded once (False: no malloc_trim)


def release_free_heap() -> bool:
    """``malloc_trim(0)``: True if the allocator released memory."""
    global _libc
    if _libc is None:
        try:
            name = ctypes.util.find_library("c")
            _libc = ctypes.CDLL(name) if name else False
            if _libc and not hasattr(_libc, "malloc_trim"):
                _libc = False
        except OSError:
            _libc = False
    if not _libc:
        return False
    try:
        return bool(_libc.malloc_trim(0))  # type: ignore[union-attr]
    except Exception as exc:  # never fail a recovery over this
        log.debug("malloc_trim: %s", exc)
        return False
