"""Named points where a harness may run its own code inside a training process.

The product never injects faults; it only offers these points. A harness (the chaos campaign, a test, a
tracer) registers callbacks; with none registered a point costs one dict lookup. The fault injector of
:mod:`deadpool_ext.chaos.at_step` is installed this way by the harness (``chaos.at_step.install``), never by
the product's own code.

Points, who fires them, and with which keyword arguments:

- ``AFTER_STEP`` (every rank, main thread, after each optimizer step and its snapshot hook, before the next
  step): ``step`` (the optimizer-step counter after the step), ``rank`` (global rank), ``state`` (the rank's
  :class:`~deadpool_ext.snapshot.state.RankStateAdapter`, read only).
- ``BEFORE_RESTORE`` (every rank, main thread, before a memory-tier restore scans its buffers):
  ``generation`` (the hot-swap generation; 0 at job start), ``rank``.
- ``BEFORE_SEAL`` (every rank, main thread, after a snapshot's tensors were chosen and before its copy is
  handed to the writer, which copies, checksums and seals them): ``version``, ``rank``, ``snapshot`` (the
  :class:`~deadpool_ext.snapshot.slots.PreparedSnapshot`; a test harness may replace its tensors, e.g. the chaos
  harness's ``poison`` fault: values that pass every checksum).
- ``AFTER_RESTORE`` (every rank, main thread, after a memory-tier restore put a version in place, before the
  next step): ``generation``, ``rank``, ``version``, ``state`` (as for ``AFTER_STEP``).

A callback may raise: the exception surfaces where the point was fired (e.g. out of ``engine.step()``),
exactly as a failure there would.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

AFTER_STEP = "after_step"
BEFORE_RESTORE = "before_restore"
AFTER_RESTORE = "after_restore"
BEFORE_SEAL = "before_seal"
POINTS = (AFTER_STEP, BEFORE_RESTORE, AFTER_RESTORE, BEFORE_SEAL)

_registry: dict[str, list[Callable[..., None]]] = {}  # process-wide: a harness registers once, for every generation


def register(point: str, fn: Callable[..., None]) -> Callable[[], None]:
    """Run ``fn(**kwargs)`` whenever ``point`` fires; returns a function that unregisters it."""
    if point not in POINTS:
        raise ValueError(f"unknown hook point {point!r}; allowed: {list(POINTS)}")
    _registry.setdefault(point, []).append(fn)

    def unregister() -> None:
        fns = _registry.get(point, [])
        if fn in fns:
            fns.remove(fn)
    return unregister


def fire(point: str, **kwargs: Any) -> None:
    for fn in _registry.get(point, ()):
        fn(**kwargs)


def registered(point: str) -> int:
    """How many callbacks ``point`` has (tests, and the log line of a harness that installs one)."""
    return len(_registry.get(point, ()))
