"""TimedWork: an asynchronous collective's work whose ``wait`` on the training thread counts toward the pace.

A framework that overlaps communication (DeepSpeed ZeRO-3 prefetches the next parameters' all-gathers with
``async_op=True``) waits for the work later, in its own code: the time a rank stands there waiting for a slower peer
is time in a collective, not work of its own (``rebuild/progress.py``, the straggler rule's busy time). The
swappable gloo groups hand such works back wrapped in this class; every method forwards to the real work, and
``wait`` on the training thread adds its seconds to the pace.
"""
from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from . import progress


class TimedWork(dist.Work):
    """The work of an asynchronous collective, its wait timed (see the module docstring)."""

    def __init__(self, inner: Any) -> None:
        super().__init__()
        self.inner = inner

    def wait(self, timeout: timedelta = timedelta(0)) -> bool:
        if threading.get_ident() != progress.MAIN:
            return bool(self.inner.wait(timeout))
        t0 = time.perf_counter()
        try:
            return bool(self.inner.wait(timeout))
        finally:
            progress.note_wait(time.perf_counter() - t0)

    def is_completed(self) -> bool:
        return bool(self.inner.is_completed())

    def is_success(self) -> bool:
        return bool(self.inner.is_success())

    def exception(self) -> Any:
        return self.inner.exception()

    def source_rank(self) -> int:
        return int(self.inner.source_rank())

    def result(self) -> list[Any]:
        return list(self.inner.result())

    def synchronize(self) -> None:
        self.inner.synchronize()

    def get_future(self) -> Any:
        return self.inner.get_future()

    def __repr__(self) -> str:
        return f"TimedWork({self.inner!r})"
