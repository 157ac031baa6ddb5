"""The background snapshot worker gives way to training: its thread runs at the lowest CPU priority available.

On Linux, scheduling policy and nice value are per thread (the "process" calls act on the calling thread when
given pid 0 / its native thread id), so lowering the worker leaves the training threads as they are.
``SCHED_IDLE`` runs a thread only on cycles no normal thread wants: on a host whose cores all train, the copy,
checksums and replica sends then use the time ranks spend waiting in collectives instead of taking it from
compute. Where ``SCHED_IDLE`` is unavailable (not Linux, or refused), nice 19; where neither works, the thread
stays as it was and the result says so (logged once, never raised: priority is an optimisation).
"""
from __future__ import annotations

import logging
import os
import threading

log = logging.getLogger("deadpool_ext")


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
