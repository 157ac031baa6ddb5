"""A process's drain state (``context().drain``): requested, agreed, done. Kept apart from ``worker.py`` so that
``rebuild/context.py`` holds it without importing the worker's side."""
from __future__ import annotations

import threading

from .decide import PREEMPTED_EXIT, Outcome, resolve_grace, worker_deadline


class DrainState:
    """This process's drain (``context().drain``): requested (a SIGTERM, the store's ``drain``), agreed, done. The
    signal handler and the watcher thread write it; the training thread reads it at a boundary."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requested_at: float | None = None
        self.by = ""
        self.told = False
        """This process's own request is in the store (or there is no store)."""
        self.armed = False
        """A runtime that drains is attached (set by :func:`install`, cleared by :func:`disarm`)."""
        self.grace_s = resolve_grace(None, None).seconds
        self.outcome: Outcome | None = None
        """What this process's drain did, once it is done: the framework's next call ends the process."""
        self.watcher: threading.Thread | None = None

    def request(self, at: float, by: str) -> bool:
        """The first request wins (True); later ones (the launcher's after a worker's) only confirm it."""
        with self._lock:
            if self.requested_at is not None:
                return False
            self.requested_at, self.by = at, by
            return True

    @property
    def requested(self) -> bool:
        return self.requested_at is not None

    def deadline(self) -> float | None:
        return None if self.requested_at is None else worker_deadline(self.requested_at, self.grace_s)

    def exit_if_due(self) -> None:
        """At the framework's next call after a drain (a forward, a step): end the process, the step's own
        bookkeeping (the script's metrics line, its loop's end) done in between."""
        if self.outcome is not None:
            raise SystemExit(PREEMPTED_EXIT)


__all__ = ["DrainState"]
