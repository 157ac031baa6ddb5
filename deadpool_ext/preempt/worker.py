"""A worker's side of a drain: the SIGTERM handler, the request's watcher, the agreement at a step boundary.

Call order (every rank):

1. :func:`install` when a runtime attaches (``config.preemption.enabled``): SIGTERM no longer ends the process but
   requests a drain (:meth:`DrainState.request`); under deadpool-run a watcher thread writes this worker's request to
   the store (``drain``, first writer wins: a SIGTERM to one worker drains the whole job) and takes the launcher's
   (or another worker's) from there; rank 0 writes the job's budget (``config/preempt_grace_s``).
2. :func:`agree` at every optimizer-step boundary (collective, one all-reduce of three numbers): whether any rank
   has a request, and the earliest request and deadline among them. Every rank stops at the same boundary: no rank
   can be past it (a step needs every rank), and each learns the others' requests there.
3. The framework persists the step (``integrations/deepspeed/drain.py``) and the process ends with
   :data:`~deadpool_ext.preempt.decide.PREEMPTED_EXIT` at the framework's next call (:meth:`DrainState.exit_if_due`).

A process that cannot drain (no runtime attached yet, a spare that holds no rank, training already over) takes
SIGTERM as before: it ends at once.
"""
from __future__ import annotations

import json
import logging
import math
import os
import signal
import threading
import time
from dataclasses import dataclass
from typing import Any

from ..config import PreemptionConfig
from ..launcher import keys, values
from ..launcher.contract import worker_env
from ..rebuild.context import context
from . import messages
from .decide import resolve_grace
from .state import DrainState

log = logging.getLogger("deadpool_ext")

WATCH_S = 0.25
"""The watcher's longest wait on the store for a request (a local SIGTERM is written within it)."""


@dataclass(frozen=True, slots=True)
class Agreement:
    """Every rank drains at this boundary: the earliest request and the earliest deadline among the ranks'."""

    requested_at: float
    deadline: float
    by_rank: int
    """The lowest rank that had a request of its own (a SIGTERM, or the store's request it read)."""


def install(config: PreemptionConfig, rank: int) -> None:
    """Arm this process's drain (see the module's call order). Idempotent; a no-op with ``enabled: false``."""
    st = context().drain
    if not config.enabled:
        return
    hs = worker_env().hot_swap
    st.grace_s = resolve_grace(hs.preempt_grace_s if hs is not None else None, config.grace_s).seconds
    st.armed = True
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) is not _on_sigterm:
        signal.signal(signal.SIGTERM, _on_sigterm)
    m = context().membership
    if m is None:
        return
    if rank == 0:
        try:  # the launcher's budget when it was given no flag
            m.store.set_json(keys.JOB_GRACE, float(config.grace_s))
        except Exception as exc:  # a diagnosis only: the launcher falls back to the default
            log.debug("%s: %s", keys.JOB_GRACE, exc)
    if st.watcher is None and hs is not None:
        st.watcher = threading.Thread(target=_watch, args=(st, hs), name="deadpool-drain-watch", daemon=True)
        st.watcher.start()


def disarm() -> None:
    """Training is over in this process (its runtime closed): a SIGTERM from here on ends it at once."""
    context().drain.armed = False


def _on_sigterm(signum: int, frame: Any) -> None:
    """SIGTERM: a drain request, or, in a process that cannot drain, the default action (the process ends)."""
    st = context().drain
    m = context().membership
    holds_no_rank = m is not None and (m.assignment is None or m.worker_id not in m.assignment.ranks)
    if not st.armed or holds_no_rank:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)
        return
    who = m.worker_id if m is not None else f"rank {worker_env().rank} (pid {os.getpid()})"
    st.request(time.time(), f"SIGTERM to worker {who}")


def _watch(st: DrainState, hs: Any) -> None:
    """The watcher thread (deadpool-run): this worker's request into the store, the job's request out of it."""
    from ..store import connect
    from ..store.base import StoreTimeout

    try:
        store = connect(hs.store_url, hs.token, hs.job_id, 5.0)
    except Exception as exc:
        log.warning("drain watcher: cannot reach the store (%s); a SIGTERM still drains through the step boundary's "
                    "agreement", exc)
        return
    while st.armed and st.outcome is None:
        try:
            if st.requested and not st.told:
                assert st.requested_at is not None
                req = messages.DrainRequest(st.requested_at, st.by)
                if store.compare_set(keys.DRAIN, None, json.dumps(req.to_json()).encode()):
                    log.warning("drain requested: %s; every rank stops at its next step boundary", st.by)
                st.told = True
            if st.requested:
                time.sleep(WATCH_S)
                continue
            try:
                raw = store.wait([keys.DRAIN], WATCH_S)[keys.DRAIN]
            except StoreTimeout:
                continue
            try:
                req = messages.drain_request(keys.DRAIN, raw)
            except values.BadValue as exc:
                log.warning("%s", exc)
                time.sleep(1.0)
                continue
            if st.request(req.requested_at, req.by):
                st.told = True
                log.info("drain requested by %s: stopping at the next step boundary", req.by)
        except Exception as exc:  # noqa: BLE001 - a store outage must not end the thread; the boundary still agrees
            log.debug("drain watcher: %s", exc)
            time.sleep(WATCH_S)


def agree(st: DrainState, device: Any, rank: int = 0) -> Agreement | None:
    """Collective, every rank at every optimizer-step boundary while armed: whether any rank has a drain request,
    with the earliest request time and deadline among them and the lowest rank that had one (MAX over negations)."""
    import torch
    import torch.distributed as dist

    deadline = st.deadline()
    mine = ([1.0, -deadline, -(st.requested_at or 0.0), -float(rank)] if deadline is not None
            else [0.0, -math.inf, -math.inf, -math.inf])
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        t = torch.tensor(mine, dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        mine = [float(x) for x in t.tolist()]
    if mine[0] <= 0:
        return None
    return Agreement(requested_at=-mine[2], deadline=-mine[1], by_rank=int(-mine[3]))


__all__ = ["Agreement", "DrainState", "agree", "disarm", "install"]
