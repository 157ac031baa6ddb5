"""Waiting on a condition instead of sleeping: a deadline, and a message naming what was waited for."""
from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_until(cond: Callable[[], T], timeout_s: float, what: str, *, interval_s: float = 0.02) -> T:
    """Poll ``cond()`` until it returns something truthy, and return that; ``TimeoutError`` naming ``what``
    once ``timeout_s`` has passed (``cond`` is checked one last time at the deadline)."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = cond()
        if got:
            return got
        if time.monotonic() >= deadline:
            raise TimeoutError(f"waited {timeout_s:g}s for {what}")
        time.sleep(interval_s)


def holds_for(cond: Callable[[], object], window_s: float, what: str, *, interval_s: float = 0.02) -> None:
    """Check that ``cond()`` stays truthy for the whole of ``window_s`` (polled): the bounded wait of a test that
    something does NOT happen within a window. ``AssertionError`` naming ``what`` the first time it is false."""
    start = time.monotonic()
    while True:
        if not cond():
            raise AssertionError(f"{what}: no longer true after {time.monotonic() - start:.2f}s of {window_s:g}s")
        if time.monotonic() - start >= window_s:
            return
        time.sleep(interval_s)
