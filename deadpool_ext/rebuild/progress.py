"""This process's training progress, as its heartbeat reports it: how the launcher tells a hung rank from a slow one.

A heartbeat says the process is alive; it cannot say that training is. A rank whose main thread is blocked (a
deadlock, a stuck I/O call, the shape of a hung collective) keeps heartbeating while every other rank waits for
it in its next collective. Two signals, both read on the heartbeat thread (the training thread pays two stores
per step in :func:`note_step`):

- steps: :func:`note_step` after every optimizer step (``integrations/base.py``, every integration's runtime);
- the main thread's stack, sampled at each heartbeat (:func:`sample`): whether it is inside a torch.distributed
  call (waiting in a collective, or in a store rendezvous) and for how long its innermost frames have not
  changed (a thread computing in Python changes them at every sample; one blocked in a C call does not).

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

_MAIN = threading.main_thread().ident
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
        self._signature: tuple[tuple[int, int], ...] | None = None
        self._still_since = 0.0
        self._lock = threading.Lock()
        self._told_first = False

    def note_step(self, step: int) -> None:
        self.step, self.step_at = step, time.time()
        if not self._told_first:  # the job's start-up ends at its first step (recovery/ledger.py's ``startup``)
            self._told_first = True
            from ..recovery.timeline import write_event

            write_event(event="first_step", step=step, time=self.step_at)

    def reset(self) -> None:
        with self._lock:
            self.step, self.step_at, self._signature = -1, 0.0, None

    def sample(self) -> dict[str, Any]:
        frame = sys._current_frames().get(_MAIN) if _MAIN is not None else None
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
        out: dict[str, Any] = {"step": self.step, "step_at": self.step_at, "coll": in_collective,
                               "still_s": round(still, 3)}
        prepared = self.prepared
        if prepared is not None:
            out["prepared"] = list(prepared)
        return out


def _progress() -> Progress:
    from .context import context

    return context().progress


def note_step(step: int) -> None:
    """The training thread finished optimizer step ``step``."""
    _progress().note_step(step)


def reset() -> None:
    """A new generation of this process (a spare taking a node's place starts counting at its first step)."""
    _progress().reset()


def sample() -> dict[str, Any]:
    """``{"step", "step_at", "coll", "still_s"}``: the last finished step (-1: none yet) and when (epoch seconds),
    whether the main thread is inside a torch.distributed call, and how long its innermost frames have been the
    same (seconds, as seen by the successive samples)."""
    return _progress().sample()
