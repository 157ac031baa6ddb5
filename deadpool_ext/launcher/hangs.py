"""The coordinator's reading of heartbeats: what a worker's ``hb/`` value says, which ranks are alive but not
training, whether a new generation has formed, and what a lost spare is told (pure: no store, no processes;
``rebuild/progress.py`` is the worker's side)."""
from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Set
from typing import Any

from .keys import HEARTBEATS
from .values import BadValue, heartbeat  # the schema lives with every other store value's

log = logging.getLogger("deadpool_ext.launcher")


def parse_heartbeat(raw: bytes) -> dict[str, Any] | None:
    """A worker's ``hb/`` value: JSON ``{"t", "step", "step_at", "coll", "still_s"}`` (or a bare time, from an older
    worker); None for anything else (logged: a heartbeat nobody can read must not pass for a live one)."""
    try:
        return heartbeat(HEARTBEATS, raw)
    except BadValue as exc:
        log.warning("unreadable heartbeat: %s", exc)
        return None


def stalled(progress: Mapping[str, dict[str, Any] | None], active: Set[str], now: float,
            limit_s: float) -> tuple[dict[str, str], bool]:
    """``(failed, all_in_collective)``. The rule: no active rank finished a step for ``limit_s``, at least one waits
    inside a collective, and a rank whose main thread has stood still outside any collective for that long is the
    one they wait for (``failed``: worker -> why). ``all_in_collective``: stalled with every rank inside a
    collective, where no rank can be singled out. Off for ``limit_s <= 0``, and while any rank has not finished its
    first step (start-up, a spare that just took over)."""
    beats = {w: progress.get(w) for w in active}
    if limit_s <= 0 or not beats or any(b is None or int(b["step"]) < 0 for b in beats.values()):
        return {}, False
    known = {w: b for w, b in beats.items() if b is not None}
    stalled_s = {w: now - float(b["step_at"]) for w, b in known.items()}
    if min(stalled_s.values()) <= limit_s:
        return {}, False
    waiting = [w for w, b in known.items() if b["coll"]]
    stuck = {w: b for w, b in known.items() if not b["coll"] and float(b["still_s"]) > limit_s}
    if not waiting or not stuck:
        return {}, bool(waiting) and len(waiting) == len(known)
    return {w: (f"no progress: step {b['step']} finished {stalled_s[w]:.1f}s ago and its main thread has stood "
                f"still outside any collective for {float(b['still_s']):.1f}s while {len(waiting)} rank(s) wait "
                f"in one (heartbeat alive; SIGKILLed to fence it)") for w, b in stuck.items()}, False


def store_stalled(beats: Mapping[str, float], now: float, limit_s: float) -> bool:
    """Whether every worker's last heartbeat (``worker -> its time``, spares included) is older than ``limit_s``:
    nobody could write to the store (an etcd member lost and its leader being re-elected, seen holding every
    heartbeat of a bed job for 7 s), which says nothing about any one worker. With fewer than two heartbeats there
    is nothing to compare, and the plain rule applies."""
    return len(beats) >= 2 and all(now - t > limit_s for t in beats.values())


def not_formed(ranks: Iterable[str], progress: Mapping[str, Mapping[str, Any] | None], since: float) -> list[str]:
    """The ranks (worker ids) of a generation published at ``since`` (epoch seconds) that have not yet finished
    a step in it: their last heartbeat's progress sample is missing or its ``step_at`` is older. Empty: the
    generation has formed (``resize.py``: a grow waits for it)."""
    return sorted(w for w in ranks if float((progress.get(w) or {}).get("step_at", 0.0)) < since)


def prepared_spares(beats: Mapping[str, Mapping[str, Any]]) -> dict[str, tuple[int, int]]:
    """Worker -> (rank, world size) its engine was built ahead for, as its heartbeat says (a waiting spare's,
    ``rebuild/spare.py``; the decoder checked both numbers)."""
    out: dict[str, tuple[int, int]] = {}
    for w, beat in beats.items():
        p = beat.get("prepared")
        if isinstance(p, (list, tuple)) and len(p) == 2:
            out[w] = (int(p[0]), int(p[1]))
    return out


def spare_lost_line(worker: str, rc: int | None, detail: str, left: list[str]) -> str:
    """The warning a lost spare gets (pure): a spare that exits before any assignment has failed in its start-up
    (its script up to the engine, built ahead, or its wait), and the job is one spare short from now on."""
    cause = (f"its host was lost ({detail})" if rc is None else
             f"it was killed ({detail})" if rc < 0 else
             f"it {detail} before any assignment: its script ran to its end without waiting (did no engine attach "
             "the extension?)" if rc == 0 else
             f"it failed at start-up, before any assignment ({detail}; its own lines above name the error)")
    spares = f"{len(left)} spare node(s) left ({', '.join(left)})" if left else "no spare left"
    return f"spare {worker} lost: {cause}; {spares}"
