"""A benchmark's probe of the allocator, not part of the product: on ``PYTHONPATH`` (``bench_five_swaps.py`` puts this
folder there for its jobs), each active node's worker (``DEADPOOL_WORKER_ID`` ``node<i>.<j>``) writes, once a second,
what glibc's allocator holds for it (``mallinfo2``): the bytes in use (``uordblks``, in the heap, plus ``hblkhd``,
the chunks mapped on their own) and the free bytes it keeps in its heap (``fordblks``), which the process's RSS
counts too and which come and go with the order of allocations, not with what is alive.

Spares never run it: their warm parent refuses to fork beside another Python thread (``rebuild/warm.py``). Nothing
is written unless ``DEADPOOL_BENCH_HEAP_DIR`` names the folder; one file per process,
``<worker id>.<pid>.jsonl``."""
from __future__ import annotations

import os
import re

_DIR = os.environ.get("DEADPOOL_BENCH_HEAP_DIR")
_WID = os.environ.get("DEADPOOL_WORKER_ID", "")


def _start() -> None:
    import ctypes
    import json
    import threading
    import time

    class MallInfo2(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                   "fsmblks", "uordblks", "fordblks", "keepcost")]

    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = MallInfo2
    except (OSError, AttributeError):
        return  # not glibc 2.33+: nothing to read
    os.makedirs(_DIR or ".", exist_ok=True)
    path = os.path.join(_DIR or ".", f"{_WID}.{os.getpid()}.jsonl")

    def loop() -> None:
        while True:
            m = libc.mallinfo2()
            rec = {"t": time.time(), "live": m.uordblks + m.hblkhd, "free": m.fordblks, "arena": m.arena}
            with open(path, "a") as fh:
                fh.write(json.dumps(rec) + "\n")
            time.sleep(1.0)

    threading.Thread(target=loop, name="bench-heap-probe", daemon=True).start()


if _DIR and re.fullmatch(r"node\d+\.\d+", _WID):
    _start()
