"""One resilient training loop for every integration: run steps until done; a failure the runtime can recover
(a peer lost under deadpool-run) is recovered in-process and the step redone on the rebuilt world.

    loop = ResilientLoop(engine, runtime=lambda e: e.deadpool, done=lambda e: e.global_steps >= iters,
                         step=train_one_step, after_swap=lambda e: e.train())
    for engine, out in loop:          # one item per completed step; engine is the current handle
        log_metrics(out)
    loop.swaps                        # how many hot-swaps happened

``handle`` is whatever the loop holds between steps (a DeepSpeed engine, a Megatron runtime); ``runtime(h)``
its :class:`~deadpool_ext.integrations.base.ResilientRuntime` (or None: no recovery); ``step(h)`` runs one
optimizer step and returns what the loop body needs. Any exception the runtime cannot recover propagates
unchanged.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

from .base import ResilientRuntime

H = TypeVar("H")
R = TypeVar("R")


class ResilientLoop(Generic[H, R]):
    def __init__(self, handle: H, *, runtime: Callable[[H], ResilientRuntime | None], done: Callable[[H], bool],
                 step: Callable[[H], R], after_swap: Callable[[H], None] | None = None) -> None:
        self.handle = handle
        self.swaps = 0
        self._runtime, self._done, self._step, self._after_swap = runtime, done, step, after_swap

    def __iter__(self) -> Iterator[tuple[H, R]]:
        while True:
            try:
                if self._done(self.handle):
                    # The last step's snapshot is drained here, inside the recovery scope: a peer lost while it
                    # was replicated or committed is a failure like any other (recovered, the step redone if
                    # the restored version is older), not an error at the end of a finished loop.
                    rt = self._runtime(self.handle)
                    if rt is not None:
                        rt.drain()
                    return
                out = self._step(self.handle)
            except Exception as exc:
                rt = self._runtime(self.handle)
                handle = rt.handle_failure(exc) if rt is not None else None
                if handle is None:
                    raise
                self.handle = handle
                self.swaps += 1
                if self._after_swap is not None:
                    self._after_swap(self.handle)
                continue
            yield self.handle, out
