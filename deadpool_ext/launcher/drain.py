"""A preemption's drain, the launcher's part (every launcher; ``preempt/`` has the rules and the workers' part).

Call order (``cli.py`` ``Supervisor``):

1. SIGTERM to the launcher once its workers run: :meth:`LauncherDrain.notice` (from the signal handler: a time, no
   I/O). Before that the launcher ends as it always did (status 143).
2. Every loop turn, first: :meth:`LauncherDrain.tick` writes the request (``drain``, first writer wins) and reads the
   job's (a worker that got SIGTERM itself writes it too), so every launcher of the job drains; from then on the
   coordinator's observations go through :func:`drained_observation` (a worker that exits with status 75 drained:
   it is done, not failed; a spare's exit is no failure either), and the turn checks :meth:`LauncherDrain.over`:
   every local worker of the current generation exited, or the budget is spent (the rest SIGKILLed).
3. :meth:`LauncherDrain.end`: rank 0's outcome (``drained``) read, the final line printed, the exit status
   (``decide.exit_status``: 75, or 0 when the job finished all the same).
"""
from __future__ import annotations

import dataclasses
import json
import logging
import sys
import time
from collections.abc import Callable, Collection, Mapping
from typing import Any

from ..preempt import decide, messages
from . import keys, values
from .decide import Observation

log = logging.getLogger("deadpool_ext.launcher")


def drained_observation(obs: Observation, ranks: Collection[str], *, draining: bool) -> Observation:
    """A coordinator's observation with the drain's exits read as such (pure): an active worker that exited with
    :data:`~deadpool_ext.preempt.decide.PREEMPTED_EXIT` is done, never failed (its drain ended it, and it may end
    before this launcher reads the request); while ``draining``, a spare's exit is dropped too (a SIGTERM sent to
    every process of the job ends the spares: not a dead spare to replace), and so is a host whose lease lapsed
    (its launcher ended once its workers drained, possibly before its workers' exits were read here: under Slurm
    every launcher is signalled, and each leaves when its part is done)."""
    exits: dict[str, int] = {}
    done = set(obs.done)
    for wid, rc in obs.exits.items():
        if wid in ranks and rc == decide.PREEMPTED_EXIT:
            done.add(wid)
        elif wid in ranks or not draining:
            exits[wid] = rc
    hosts_now = obs.hosts_now | obs.hosts_seen if draining else obs.hosts_now
    if exits == obs.exits and done == obs.done and hosts_now == obs.hosts_now:
        return obs
    return dataclasses.replace(obs, exits=exits, done=frozenset(done), hosts_now=hosts_now)


def local_workers_exited(ranks: Collection[str], local: Collection[str], exits: Mapping[str, int]) -> bool:
    """Whether every worker of the current generation that runs on this host has exited (pure)."""
    return all(wid in exits for wid in ranks if wid in local)


class LauncherDrain:
    """One launcher's drain: the request, the budget, the end."""

    def __init__(self, flag_grace_s: float | None, host_rank: int, event: Callable[..., None]) -> None:
        self.flag = flag_grace_s
        self.host_rank = host_rank
        self.event = event
        self.signalled_at: float | None = None
        self._written = False
        self.request: messages.DrainRequest | None = None
        self.grace: decide.Grace | None = None
        self.deadline: float | None = None

    @property
    def active(self) -> bool:
        return self.request is not None

    def notice(self) -> None:
        """SIGTERM to this launcher (called from the signal handler: no I/O)."""
        if self.signalled_at is None:
            self.signalled_at = time.time()

    def tick(self, store: Any, reads: values.StoreValues) -> bool:
        """Every turn: this launcher's request into the store, the job's request out of it; True while draining."""
        if self.signalled_at is not None and not self._written:
            req = messages.DrainRequest(self.signalled_at, f"SIGTERM to the launcher of host {self.host_rank}")
            store.compare_set(keys.DRAIN, None, json.dumps(req.to_json()).encode())
            self._written = True
        if self.request is None:
            seen = reads.get(keys.DRAIN, messages.drain_request)
            if seen is None:
                return False
            req = seen
            now = time.time()
            job_grace = None if self.flag is not None else reads.get(keys.JOB_GRACE, messages.grace_seconds)
            self.request, self.grace = req, decide.resolve_grace(self.flag, job_grace)
            # this host's clock: the request may come from another host's
            self.deadline = decide.launcher_deadline(min(now, self.signalled_at or now), self.grace.seconds)
            self.event(event="drain", by=req.by, requested_at=req.requested_at, grace_s=self.grace.seconds,
                       grace_from=self.grace.source, host_rank=self.host_rank)
            log.warning("drain: %s; every rank stops at its next step boundary and persists it (budget %g s, %s)",
                        req.by, self.grace.seconds, self.grace.source)
        return True

    def over(self, ranks: Collection[str], local: Collection[str], exits: Mapping[str, int], now: float,
             reads: values.StoreValues | None = None) -> bool:
        """Whether this launcher's part of the drain is over: its workers exited, or the budget is spent. A launcher
        that holds no rank (only spares, as the spare nodes of a Slurm allocation do) waits for the job's outcome
        (rank 0's ``drained``) in ``reads``, so that its line, too, says which step is safe."""
        if self.deadline is not None and now >= self.deadline:
            return True
        if reads is None or any(wid in local for wid in ranks):
            return local_workers_exited(ranks, local, exits)
        try:
            return reads.get(keys.DRAINED, messages.drain_outcome) is not None
        except Exception as exc:  # the store gone for a moment: the deadline ends the wait
            log.debug("%s: %s", keys.DRAINED, exc)
            return False

    def end(self, reads: values.StoreValues, ranks: Collection[str], local: Collection[str],
            exits: Mapping[str, int], *, stopped: bool = False) -> int:
        """The final line and the launcher's exit status (the caller then SIGKILLs what is left)."""
        try:
            rec = reads.get(keys.DRAINED, messages.drain_outcome)
        except Exception as exc:  # the store gone: no outcome to report, the line says so
            log.debug("%s: %s", keys.DRAINED, exc)
            rec = None
        outcome = None if rec is None else decide.Outcome(step=rec.step, persisted=rec.persisted, safe=rec.safe,
                                                          url=rec.url, seconds=rec.seconds, why=rec.why)
        mine = [exits.get(wid) for wid in ranks if wid in local]
        finished = bool(mine) and all(rc == 0 for rc in mine)
        rc = decide.exit_status(finished=finished, stopped=stopped)
        assert self.grace is not None and self.request is not None
        late = [wid for wid in ranks if wid in local and wid not in exits]
        self.event(event="drained", status=rc, step=None if outcome is None else outcome.step,
                   persisted=None if outcome is None else outcome.persisted,
                   safe=None if outcome is None else outcome.safe, seconds=None if outcome is None else outcome.seconds,
                   killed_late=late, host_rank=self.host_rank)
        if rc == 0:
            print("deadpool-run: the job finished during the drain (its last step came first); exit status 0",
                  file=sys.stderr, flush=True)
        else:
            print(f"deadpool-run: {decide.final_line(outcome, self.grace, self.request.by)}", file=sys.stderr,
                  flush=True)
        return rc


__all__ = ["LauncherDrain", "drained_observation", "local_workers_exited"]
