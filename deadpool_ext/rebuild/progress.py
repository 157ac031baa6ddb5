"""This process's training progress, as its heartbeat reports it: how the launcher tells a hung rank from a slow one.

A heartbeat says the process is alive; it cannot say that training is. A rank whose main thread is blocked (a
deadlock, a stuck I/O call, the shape of a hung collective) keeps heartbeating while every other rank waits for
it in its next collective. Two signals, both read on the heartbeat thread (the training thread pays two stores
per step in :func:`note_step`):

- steps: :func:`note_step` after every optimizer step (``integrations/base.py``, every integration's runtime);
- the main thread's stack, sampled at each heartbeat (:func:`sample`): whether it is inside a torch.distributed
  call (waiting in a collective, or in a store rendezvous) and for how long its innermost frames have not
  changed (a thread computing in Python changes them at every sample; one blocked in a C call does not);
- the pace (issue 46, part 1): steps finished in this generation, their wall seconds and the seconds the training
  thread spent in collectives meanwhile (:func:`note_wait`, timed by ``swap.py``'s swappable gloo groups), as
  running totals. A synchronous job's ranks all take the same wall time per step (each waits for the slowest in
  its collectives), so what tells a straggler is the step's time *outside* collectives
  (``launcher/straggler.py``).

The launcher's rule (``launcher/cli.py``, ``--progress-timeout-s``): when no active rank has finished a step for
that long and at least one waits inside a collective, a rank whose main thread has stood still *outside* any
collective for that long is hung: it is fenced and replaced. When every rank is inside a collective, no rank can
be singled out from its stack; that case is left to the collective timeout (docs/hot-swap.md, timeouts).
"""
from __future__ import annotations

import os
import sys
import threading
import time
from typing import Any

MAIN = threading.main_thread().ident
_TOP_FRAMES = 6
_MAX_DEPTH = 200
_COLLECTIVE_PATHS = (f"{os.sep}torch{os.sep}distributed{os.sep}", f"{os.sep}deepspeed{os.sep}comm{os.sep}",
                     f"deadpool_ext{os.sep}rebuild{os.sep}swap.py")

class Progress:
    """One process's progress record (held by ``rebuild/context.py``; the functions below reach it)."""

    def __init__(self) -> None:
        self.step = -1
        self.step_at = 0.0
        self.prepared: tuple[int, int] | None = None
        """A spare built ahead: the (rank, world size) of its engine, in every heartbeat (``rebuild/spare.py``)."""
        self.tier3: int | None = None
        """The newest step this process published, verified, as a tier-3 base (the coordinating rank's writer:
        ``integrations/deepspeed/tier3.py``), in every heartbeat: the step a stopped job says is safe."""
        self._signature: tuple[tuple[int, int], ...] | None = None
        self._still_since = 0.0
        self._lock = threading.Lock()
        self._told_first = False
        self.pace_n, self.pace_step_s, self.pace_wait_s, self.pace_measured = 0, 0.0, 0.0, False
        """Running totals of this process: steps timed, their wall seconds, their seconds in collectives, and
        whether any collective was timed (only swappable gloo groups are: see ``note_wait``)."""
        self._wait_s = 0.0
        self._last_step: tuple[float, int | None] | None = None  # (monotonic time, generation) of the last step

    def note_wait(self, seconds: float) -> None:
        """The training thread spent ``seconds`` in a collective (called on that thread only)."""
        self._wait_s += seconds
        self.pace_measured = True

    def note_step(self, step: int, generation: int | None = None) -> None:
        self.step, self.step_at = step, time.time()
        now = time.monotonic()
        last = self._last_step
        # a step whose interval spans a recovery (a new generation) is not timed: the recovery is not its pace
        if last is not None and last[1] == generation:
            with self._lock:
                self.pace_n += 1
                self.pace_step_s += now - last[0]
                self.pace_wait_s += self._wait_s
        self._last_step, self._wait_s = (now, generation), 0.0
        if not self._told_first:  # the job's start-up ends at its first step (recovery/ledger.py's ``startup``)
            self._told_first = True
            from ..recovery.timeline import write_event

            write_event(event="first_step", step=step, time=self.step_at)

    def reset(self) -> None:
        with self._lock:
            self.step, self.step_at, self._signature = -1, 0.0, None

    def sample(self) -> dict[str, Any]:
        frame = sys._current_frames().get(MAIN) if MAIN is not None else None
        top: list[tuple[int, int]] = []
        in_collective = False
        depth = 0
        while frame is not None and depth < _MAX_DEPTH:
            if len(top) < _TOP_FRAMES:
                top.append((id(frame.f_code), frame.f_lineno or 0))
            if not in_collective and any(p in frame.f_code.co_filename for p in _COLLECTIVE_PATHS):
                in_collective = True
            frame = frame.f_back
            depth += 1
        now = time.monotonic()
        signature = tuple(top)
        with self._lock:
            if signature != self._signature:
                self._signature, self._still_since = signature, now
            still = now - self._still_since
            pace = [self.pace_n, round(self.pace_step_s, 6), round(self.pace_wait_s, 6), self.pace_measured]
        out: dict[str, Any] = {"step": self.step, "step_at": self.step_at, "coll": in_collective,
                               "still_s": round(still, 3), "pace": pace}
        prepared = self.prepared
        if prepared is not None:
            out["prepared"] = list(prepared)
        if self.tier3 is not None:
            out["tier3"] = self.tier3
        return out


def timed(op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """A collective issued by the training thread (``swap.py``'s gloo groups), its time added to the pace: a
    synchronous one (its options' ``asyncOp`` false) is waited for here, where it is timed, instead of right after
    in torch's Python API (which then finds it complete). An asynchronous one (ZeRO-3's prefetching all-gathers) is
    timed up to its return, and its work handed back as a ``timed_work.TimedWork`` whose ``wait`` on the training
    thread is timed too; one without options (send, recv) up to its return only. NCCL's waits are the device's, not
    the host's: NCCL groups are not timed."""
    t0 = time.perf_counter()
    work = op(*args, **kwargs)
    flags = [f for a in (*args, *kwargs.values()) if isinstance(f := getattr(a, "asyncOp", None), bool)]
    if work is not None and flags and not flags[0]:
        work.wait()
    _progress().note_wait(time.perf_counter() - t0)
    if work is not None and flags and flags[0]:
        from .timed_work import TimedWork

        return TimedWork(work)
    return work


def _progress() -> Progress:
    from .context import context

    return context().progress


def note_step(step: int) -> None:
    """The training thread finished optimizer step ``step``."""
    from .context import context

    ctx = context()
    ctx.progress.note_step(step, ctx.generation)


def note_wait(seconds: float) -> None:
    """The training thread spent ``seconds`` in a collective (``swap.py``)."""
    _progress().note_wait(seconds)


def reset() -> None:
    """A new generation of this process (a spare taking a node's place starts counting at its first step)."""
    _progress().reset()


def last_step() -> int:
    """The last optimizer step the training thread finished (-1: none yet)."""
    return _progress().step


def sample() -> dict[str, Any]:
    """``{"step", "step_at", "coll", "still_s", "pace"}``: the last finished step (-1: none yet) and when (epoch
    seconds), whether the main thread is inside a torch.distributed call, how long its innermost frames have been
    the same (seconds, as seen by the successive samples), and the pace ``[steps, step seconds, collective seconds,
    measured]`` (running totals; ``measured``: collectives are timed in this process)."""
    return _progress().sample()
