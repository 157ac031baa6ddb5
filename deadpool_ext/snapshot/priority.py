"""The background snapshot worker gives way to training: its thread runs at the lowest CPU priority available, and
is raised back to normal while the training thread waits for it.

On Linux, scheduling policy and nice value are per thread (the "process" calls act on one thread when given its
native thread id), so lowering the worker leaves the training threads as they are. ``SCHED_IDLE`` runs a thread
only on cycles no normal thread wants: the copy, checksums and replica sends then use the time ranks spend
waiting in collectives instead of taking it from compute. Where ``SCHED_IDLE`` is unavailable (not Linux, or
refused), nice 19; where neither works, the thread stays as it was and the result says so (logged once, never
raised: priority is an optimisation).

The hazard of a low priority, and how it is handled: on a host whose cores are all busy, a thread at idle priority
may not run at all, and the training thread must wait for the copy of the previous version before the next
optimizer step overwrites the tensors (measured: a 3-rank tiny job on 2 cores waited 574 ms per snapshot instead of
0.6 ms). So the waiting thread **boosts** the worker back to normal priority for the rest of that copy
(:meth:`WorkerPriority.boost`), and the worker lowers itself again when it takes its next job. Raising a thread's
priority needs ``CAP_SYS_NICE`` (root, or a container granted it) or an ``RLIMIT_NICE`` of 20, which not every job
has; :func:`can_boost` finds out once per process with a throwaway thread, and ``auto`` (the default level) is
``idle`` only where the boost works, else ``normal``.

Call order: ``WorkerPriority(level)`` anywhere; ``lower()`` on the worker thread (first thing, and at the start of
every job); ``boost()`` on any other thread, only while it waits for the worker.
"""
from __future__ import annotations

import logging
import os
import threading

log = logging.getLogger("deadpool_ext")

LEVELS = ("auto", "idle", "low", "normal")

_can_boost: tuple[bool, str] | None = None  # process-wide: a probe of what this process may do, run once


def _set(tid: int, policy: int | None, nice: int) -> None:
    if policy is not None:
        os.sched_setscheduler(tid, policy, os.sched_param(0))
    os.setpriority(os.PRIO_PROCESS, tid, nice)


def can_boost() -> tuple[bool, str]:
    """(whether a thread of this process can be lowered and raised back to normal, why not). Probed once with a
    throwaway thread that lowers itself and asks to be raised again."""
    global _can_boost
    if _can_boost is not None:
        return _can_boost
    out: list[tuple[bool, str]] = []

    def probe() -> None:
        tid = threading.get_native_id()
        try:
            nice = os.getpriority(os.PRIO_PROCESS, tid)
            idle = getattr(os, "SCHED_IDLE", None)
            if idle is not None:
                os.sched_setscheduler(0, idle, os.sched_param(0))
            os.setpriority(os.PRIO_PROCESS, tid, 19)
            _set(tid, os.SCHED_OTHER if idle is not None else None, nice)
            out.append((True, ""))
        except (AttributeError, OSError) as exc:
            out.append((False, f"{type(exc).__name__}: {exc}"))

    t = threading.Thread(target=probe, name="deadpool-priority-probe", daemon=True)
    t.start()
    t.join(5.0)
    _can_boost = out[0] if out else (False, "the probe thread did not finish")
    return _can_boost


class WorkerPriority:
    """The snapshot worker thread's CPU priority (see the module docstring for the call order)."""

    def __init__(self, level: str) -> None:
        if level not in LEVELS:
            raise ValueError(f"worker priority must be one of {', '.join(LEVELS)}; got {level!r}")
        self.requested = level
        self.level = level
        self.not_boostable: str | None = None
        """Why ``auto`` chose ``normal``: the error a lowered thread got raising itself back (None otherwise)."""
        if level == "auto":
            ok, why = can_boost()
            self.level = "idle" if ok else "normal"
            if not ok:
                self.not_boostable = why
                log.info("snapshot worker: normal CPU priority (a lowered worker could not be raised back while the "
                         "step waits for it: %s; snapshot.worker_priority: idle forces it)", why)
        self.got = "normal"
        """What ``lower`` obtained: ``idle`` (SCHED_IDLE), ``nice19``, ``normal``, or ``unchanged (<why>)``."""
        self.boosts = 0
        """How often a waiting thread raised the worker back to normal."""
        self._tid: int | None = None
        self._nice = 0
        self._boosted = False
        self._lock = threading.Lock()

    def lower(self) -> str:
        """On the worker thread: go to ``level`` (again, after a boost); returns what it got."""
        with self._lock:
            if self._tid is None:
                self._tid = threading.get_native_id()
                self._nice = os.getpriority(os.PRIO_PROCESS, self._tid) if hasattr(os, "getpriority") else 0
            elif not self._boosted:
                return self.got
            self._boosted = False
            self.got = lower_thread_priority(self.level)
            return self.got

    def boost(self) -> bool:
        """On a thread about to wait for the worker: raise it to normal until its next ``lower``. True if it was
        lowered and is now raised."""
        with self._lock:
            if not self._raise():
                return False
            self.boosts += 1
            return True

    def set_level(self, level: str) -> None:
        """From any thread: use ``level`` (``idle``, ``low``, ``normal``) from the worker's next job on (the worker
        is raised to normal now if it was lowered). Benchmarks compare levels inside one job with it."""
        if level not in LEVELS[1:]:
            raise ValueError(f"worker priority level must be one of idle, low, normal; got {level!r}")
        with self._lock:
            self._raise()
            self.level = level
            self._boosted = True  # the next lower() applies the new level

    def _raise(self) -> bool:
        if self._tid is None or self._boosted or self.got == "normal" or self.got.startswith("unchanged"):
            return False
        try:
            _set(self._tid, os.SCHED_OTHER if self.got == "idle" else None, self._nice)
        except (AttributeError, OSError) as exc:
            log.debug("snapshot worker: could not raise its priority while the step waits (%s)", exc)
            return False
        self._boosted = True
        self.got = "normal"
        return True


def lower_thread_priority(level: str) -> str:
    """Lower the calling thread to ``level`` (``idle``, ``low``, ``normal``); returns what it got: ``idle``
    (SCHED_IDLE), ``nice19``, ``normal``, or ``unchanged (<why>)``."""
    if level == "normal":
        return "normal"
    if level == "idle" and hasattr(os, "sched_setscheduler") and hasattr(os, "SCHED_IDLE"):
        try:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # pid 0: this thread
            return "idle"
        except OSError as exc:
            log.debug("snapshot worker: SCHED_IDLE refused (%s); trying nice 19", exc)
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, 19)
        return "nice19"
    except (AttributeError, OSError) as exc:
        log.info("snapshot worker: could not lower its CPU priority (%s); it competes with training for CPU", exc)
        return f"unchanged ({exc})"
