"""The goodput ledger: where a job's wall-clock seconds went, from the events of its timeline (pure: no clock, no
files, no processes).

It reads the same events as ``deadpool timeline`` and splits each hot-swap with the same phases
(:func:`~deadpool_ext.recovery.timeline.phases`), so its figures are that table's:

- ``detect``        the row's ``detect_s`` (failure -> the launcher's detection);
- ``spare_wait``    the row's ``spare_s`` (the assignment -> the spare ready to join: its prologue and engine build
                    when it had not built ahead), and the ``assign_s`` of a failure that found no spare until a
                    machine joined as one (``--no-spare-policy wait``: a ``joined`` spare between the two);
- ``communicators`` the rest of ``agree_s`` (the next generation published, every rank's groups formed);
- ``rebuild``, ``restore``, ``recompute``: the row's ``rebuild_s``, ``restore_s``, ``recompute_s``;
- ``startup``       the launcher's ``start`` -> the first step any process finished (the first ``first_step``
                    event, ``rebuild/progress.py``); ``shutdown``: the last ``trained`` event -> ``finished``;
- ``straggler``     the ``lost_s`` of ``straggler`` events (:data:`LOSS_EVENTS`);
- ``preemption``    a drain (``deadpool-run`` on SIGTERM, issue 46 part 3): its ``drain`` event (``requested_at``) ->
                    the launcher's ``drained`` event, which ends the job;
- ``other``         what a recovery's interval holds beyond its known phases (a phase its events lack).

A recovery's interval runs from its failure to its ``caught_up``; one still under way at ``end`` runs to ``end``,
its time so far in the first phase not reached yet. A failure during an earlier recovery starts where that one's
interval stopped, so no second is counted twice. Productive seconds are what no lost interval covers, measured
on their own (:func:`uncovered`), so ``productive + sum(lost) == wall`` is a check of the split, not its
definition (``tests/unit/test_ledger.py``).
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from .timeline import phases

CAUSES = ("startup", "detect", "communicators", "spare_wait", "rebuild", "restore", "recompute", "straggler",
          "preemption", "shutdown", "other")
"""Every cause of lost seconds, in the order a recovery meets them (each one always present, zero or not)."""

TIERS = ("tier1", "tier2", "tier3", "resharded")
"""Where a recovery's state came from: the survivors' own memory, a peer's replica, storage, a reshard."""

FAILURE_CAUSES = (("exited", "crash"), ("host", "host_lost"), ("hung: no heartbeat", "hang"),
                  ("no progress", "stall"), ("straggler", "straggler"), ("preempt", "preemption"))
"""A ``failure`` event's ``why`` (decide.py's wording, by its first words) -> the recovery's cause label."""

SNAPSHOT = "snapshot"
"""The event a rank's snapshot writer writes after a global commit (``snapshot/writer.py``), at most every
``SNAPSHOT_EVENT_EVERY_S``: ``rank``, ``version``, ``step_at`` (the snapshot's start), ``blocking_s``, ``nbytes``,
``commit_lag_s``, ``committed``."""
FIRST_STEP = "first_step"
"""A process finished its first optimizer step (``rebuild/progress.py``): the job's start-up ends at the first."""
STRAGGLER = "straggler"
"""A rank named a straggler (issue 46, part 1): counted; its ``lost_s``, if any, is the ``straggler`` cause's."""
QUARANTINE_EVENTS = ("canary_rollback", "canary_stop")
"""The numerical canary's events (issue 46, part 2, ``integrations/canary.py``): the versions they name (``version``,
and a rollback's ``quarantined`` list) are the versions quarantined."""
DRAIN, DRAINED = "drain", "drained"
"""A preemption's drain (issue 46, part 3, ``launcher/drain.py``): requested, then over (the launcher's
``drained`` ends the job; a worker's own ``drained`` event does not)."""
PACE = "pace"
"""The job's pace over the last straggler window (``launcher/straggler.py``, once per window): only the newest
counts (:class:`PaceFigures`)."""
LOSS_EVENTS = {STRAGGLER: "straggler"}
"""Events whose ``lost_s`` (seconds, ending at the event's ``time``) the ledger books under a cause."""
END_EVENTS = ("finished", "stopped")


@dataclass(frozen=True, kw_only=True, slots=True)
class SnapshotFigures:
    """The newest ``snapshot`` event of each rank, summed up over the ranks."""

    blocking_s: float | None = None
    """The training thread's wait for the newest snapshot, the slowest rank's."""
    nbytes: int | None = None
    """Bytes of one version, every rank's blob together."""
    commit_lag_s: float | None = None
    """The newest snapshot's start -> its global commit, the slowest rank's."""
    committed: int | None = None
    """The newest version committed on every rank."""


@dataclass(frozen=True, kw_only=True, slots=True)
class PaceFigures:
    """The newest ``pace`` event: the job's step and its nodes' busy time (outside collectives) per step."""

    step_s: float | None = None
    """The median node's wall seconds per step over the window."""
    busy_median_s: float | None = None
    busy_max_s: float | None = None
    slowest_ratio: float | None = None
    """The slowest node's busy time over the other nodes' median (the straggler rule's ratio)."""


def pace_figures(events: Iterable[Mapping[str, Any]]) -> PaceFigures:
    """The newest ``pace`` event's figures (none: all None)."""
    newest = max((e for e in events if e.get("event") == PACE), key=lambda e: float(e["time"]), default=None)
    if newest is None:
        return PaceFigures()

    def num(v: Any) -> float | None:
        return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None

    slowest = newest.get("slowest")
    first = slowest[0] if isinstance(slowest, list) and slowest and isinstance(slowest[0], dict) else {}
    return PaceFigures(step_s=num(newest.get("step_s")), busy_median_s=num(newest.get("busy_median_s")),
                       busy_max_s=num(newest.get("busy_max_s")), slowest_ratio=num(first.get("ratio")))


@dataclass(frozen=True, kw_only=True, slots=True)
class Ledger:
    """Where the seconds of ``[start, end]`` went."""

    start: float | None
    """The launcher's ``start`` event (None: the timeline has none yet; every figure is zero)."""
    end: float
    """The job's end (``finished`` / ``stopped``), else the ``now`` it was computed at."""
    ended: bool
    wall_s: float
    productive_s: float
    lost_s: Mapping[str, float]
    """Cause (:data:`CAUSES`) -> seconds."""
    recoveries: Mapping[tuple[str, str], int]
    """(cause, tier) -> recoveries that caught up (:data:`FAILURE_CAUSES`' labels, :data:`TIERS`)."""
    snapshot: SnapshotFigures = field(default_factory=SnapshotFigures)
    pace: PaceFigures = field(default_factory=PaceFigures)
    spares_available: int = 0
    stragglers_named: int = 0
    versions_quarantined: int = 0
    generation: int = 0

    @property
    def goodput(self) -> float:
        """Productive seconds over wall seconds (1.0 before any second has passed)."""
        return self.productive_s / self.wall_s if self.wall_s > 0 else 1.0

    def as_dict(self) -> dict[str, Any]:
        """JSON: ``deadpool timeline --ledger``."""
        return {"start": self.start, "end": self.end, "ended": self.ended, "wall_s": self.wall_s,
                "productive_s": self.productive_s, "goodput": self.goodput, "lost_s": dict(self.lost_s),
                "recoveries": [{"cause": c, "tier": t, "count": n} for (c, t), n in sorted(self.recoveries.items())],
                "snapshot": {k: getattr(self.snapshot, k) for k in SnapshotFigures.__slots__},
                "pace": {k: getattr(self.pace, k) for k in PaceFigures.__slots__},
                "spares_available": self.spares_available, "stragglers_named": self.stragglers_named,
                "versions_quarantined": self.versions_quarantined, "generation": self.generation}


def failure_cause(why: str) -> str:
    """The cause label of a failed worker's ``why`` (:data:`FAILURE_CAUSES`; ``other`` for wording not listed)."""
    for prefix, label in FAILURE_CAUSES:
        if why.startswith(prefix):
            return label
    return "other"


def restore_tier(recovers: Iterable[Mapping[str, Any]]) -> str:
    """Where a recovery's state came from: a rank that fetched a peer's replica makes it tier 2; a reshard, a
    load from storage (``restored_from`` ``tier3``) say so; survivors restore from their own memory (tier 1)."""
    got = {r.get("restored_from") for r in recovers}
    for source, tier in (("tier3", "tier3"), ("resharded", "resharded"), ("peer", "tier2")):
        if source in got:
            return tier
    return "tier1"


def uncovered(start: float, end: float, intervals: Iterable[tuple[float, float]]) -> float:
    """Seconds of ``[start, end]`` that no interval covers."""
    covered, t = 0.0, start
    for a, b in sorted((max(a, start), min(b, end)) for a, b in intervals):
        if b <= t:
            continue
        covered += b - max(a, t)
        t = b
    return max(0.0, end - start - covered)


def free_parts(a: float, b: float, taken: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """The pieces of ``[a, b]`` that no interval of ``taken`` covers, in order."""
    out, t = [], a
    for lo, hi in sorted(taken):
        if hi <= t or lo >= b:
            continue
        if lo > t:
            out.append((t, lo))
        t = max(t, hi)
    if b > t:
        out.append((t, b))
    return out


def _split(row: Mapping[str, Any], joined_at: list[float]) -> list[tuple[str, float | None]]:
    """A ``phases()`` row's phases in order, as (cause, seconds or None: not reached / not recorded)."""
    spare, agree, assign = row.get("spare_s"), row.get("agree_s"), row.get("assign_s")
    detected = row.get("_detected")
    waited = assign is not None and detected is not None and any(detected < t <= detected + assign for t in joined_at)
    spare_wait = (spare or 0.0) + (assign or 0.0 if waited else 0.0) if spare is not None or waited else None
    if spare_wait is None and agree is not None:  # no spare joined (a shrink): the agreement is communicators'
        spare_wait = 0.0
    comms = None if agree is None else max(0.0, agree - (spare_wait or 0.0))
    if agree is not None and spare_wait is not None:
        spare_wait = min(spare_wait, agree)
    return [("detect", row.get("detect_s")), ("spare_wait", spare_wait), ("communicators", comms),
            ("rebuild", row.get("rebuild_s")), ("restore", row.get("restore_s")), ("recompute", row.get("recompute_s"))]


def _book(lost: dict[str, float], begin: float, lo: float, hi: float, parts: list[tuple[str, float | None]]) -> None:
    """Add the part of each phase (starting at ``begin``, back to back) that lies in ``[lo, hi]``; what the known
    phases leave of ``[begin, hi]`` goes to the first phase not reached, else to ``other``."""
    t, pending = begin, None
    for cause, seconds in parts:
        if seconds is None:
            pending = pending or cause
            continue
        a, b = t, t + max(0.0, seconds)
        lost[cause] += max(0.0, min(b, hi) - max(a, lo))
        t = b
    if hi > t:
        lost[pending or "other"] += hi - max(t, lo)


def ledger(events: Iterable[dict[str, Any]], now: float) -> Ledger:
    """The ledger of a timeline's events at ``now`` (ignored once the job ended)."""
    events = list(events)
    start_ev = next((e for e in events if e.get("event") == "start"), None)
    lost = dict.fromkeys(CAUSES, 0.0)
    if start_ev is None:
        return Ledger(start=None, end=now, ended=False, wall_s=0.0, productive_s=0.0, lost_s=lost, recoveries={})
    start = float(start_ev["time"])
    ends = [float(e["time"]) for e in events if e.get("event") in END_EVENTS
            or (e.get("event") == DRAINED and e.get("source") == "launcher")]
    ended = bool(ends)
    end = max(start, min(ends) if ended else now)
    intervals: list[tuple[float, float]] = []

    def book_interval(cause: str, a: float, b: float) -> None:
        """``[a, b]`` lost to ``cause``, less what is booked already (a recovery's seconds are its own)."""
        for lo, hi in free_parts(max(a, start), min(b, end), intervals):
            lost[cause] += hi - lo
            intervals.append((lo, hi))

    # recoveries, one after the other (a failure during a recovery starts where the earlier one stopped)
    detected_at = {int(e["generation"]) + 1: float(e["detected_at"]) for e in events if e.get("event") == "failure"}
    joined_at = [float(e["time"]) for e in events if e.get("event") == "joined" and e.get("role") == "spare"]
    rows = phases(events)
    recoveries: dict[tuple[str, str], int] = {}
    prev_hi = start
    for i, row in enumerate(rows):
        gen = int(row["generation"])
        detected = detected_at[gen]
        begin = detected - float(row["detect_s"])
        caught = begin + row["total_s"] if row.get("total_s") is not None else None
        nxt = rows[i + 1] if i + 1 < len(rows) else None
        next_begin = detected_at[int(nxt["generation"])] - float(nxt["detect_s"]) if nxt else end
        hi = min(end, caught if caught is not None else next_begin, max(next_begin, begin))
        lo = max(begin, prev_hi, start)
        if hi > lo:
            _book(lost, begin, lo, hi, _split({**row, "_detected": detected}, joined_at))
            intervals.append((lo, hi))
        prev_hi = max(prev_hi, hi)
        if caught is not None and caught <= end:
            failed: dict[str, dict[str, Any]] = row.get("failed") or {}
            why = next(iter(failed.values()), {}).get("why", "")
            recov = [e for e in events if e.get("event") == "recover" and e.get("generation") == gen]
            key = (failure_cause(str(why)), restore_tier(recov))
            recoveries[key] = recoveries.get(key, 0) + 1

    # start-up: until a process finished its first step (a recovery before it keeps its own seconds)
    firsts = [float(e["time"]) for e in events if e.get("event") == FIRST_STEP]
    if firsts:
        book_interval("startup", start, min(firsts))
    snaps = [e for e in events if e.get("event") == SNAPSHOT]
    trained = [float(e["time"]) for e in events if e.get("event") == "trained"]
    if ended and trained:
        book_interval("shutdown", max(max(trained), prev_hi), end)
    drains = [float(e.get("requested_at") or e["time"]) for e in events if e.get("event") == DRAIN]
    if drains:
        book_interval("preemption", min(drains), end)
    for e in events:
        cause = LOSS_EVENTS.get(str(e.get("event")))
        if cause is not None and isinstance(e.get("lost_s"), (int, float)) and e["lost_s"] > 0:
            t = float(e["time"])
            book_interval(cause, t - float(e["lost_s"]), t)

    wall = end - start
    return Ledger(start=start, end=end, ended=ended, wall_s=wall, productive_s=uncovered(start, end, intervals),
                  lost_s=lost, recoveries=recoveries, snapshot=snapshot_figures(snaps), pace=pace_figures(events),
                  spares_available=spares_available(events), generation=_generation(events),
                  stragglers_named=sum(1 for e in events if e.get("event") == STRAGGLER),
                  versions_quarantined=len(quarantined_versions(events)))


def snapshot_figures(snaps: Iterable[Mapping[str, Any]]) -> SnapshotFigures:
    """The newest ``snapshot`` event of each rank (of the newest generation it wrote in), summed up."""
    newest: dict[Any, Mapping[str, Any]] = {}
    for e in snaps:
        rank = e.get("rank")
        if rank not in newest or float(e["time"]) >= float(newest[rank]["time"]):
            newest[rank] = e
    if not newest:
        return SnapshotFigures()

    def top(key: str) -> float | None:
        vals = [float(e[key]) for e in newest.values() if isinstance(e.get(key), (int, float))]
        return max(vals) if vals else None

    sizes = [int(e["nbytes"]) for e in newest.values() if isinstance(e.get("nbytes"), int)]
    committed = [int(e["committed"]) for e in newest.values() if isinstance(e.get("committed"), int)]
    return SnapshotFigures(blocking_s=top("blocking_s"), nbytes=sum(sizes) if sizes else None,
                           commit_lag_s=top("commit_lag_s"), committed=min(committed) if committed else None)


def quarantined_versions(events: Iterable[Mapping[str, Any]]) -> set[int]:
    """Every version the numerical canary quarantined (its events are per rank: each version counted once)."""
    out: set[int] = set()
    for e in events:
        if e.get("event") in QUARANTINE_EVENTS:
            named = [e.get("version"), *(e.get("quarantined") or [])]
            out |= {int(v) for v in named if isinstance(v, int)}
    return out


def spares_available(events: Iterable[Mapping[str, Any]]) -> int:
    """Spare nodes waiting now: the ``start`` event's, then each assignment's ``spares_left``, plus machines that
    joined as spares, less spares lost."""
    spares: set[str] = set()
    for e in events:
        kind = e.get("event")
        if kind == "start":
            spares = set(e.get("spare_nodes") or [])
        elif kind == "assignment" and isinstance(e.get("spares_left"), list):
            spares = set(e["spares_left"])
        elif kind == "joined" and e.get("role") == "spare":
            spares.add(str(e.get("node")))
        elif kind == "spare_lost":
            spares.discard(str(e.get("node")))
    return len(spares)


def _generation(events: Iterable[Mapping[str, Any]]) -> int:
    return max([int(e["generation"]) for e in events if e.get("event") == "assignment"], default=0)


def format_ledger(led: Ledger) -> str:
    """``deadpool timeline``'s closing lines: wall, productive, goodput, and the seconds lost by cause."""
    if led.start is None:
        return "ledger: no start event (the launcher's) in this timeline"
    causes = ", ".join(f"{c} {s:.2f}" for c, s in led.lost_s.items() if s > 0) or "none"
    return (f"ledger ({'ended' if led.ended else 'so far'}): wall {led.wall_s:.2f} s = productive "
            f"{led.productive_s:.2f} s (goodput {led.goodput:.3f}) + lost {sum(led.lost_s.values()):.2f} s "
            f"({causes})")


__all__ = ["CAUSES", "FIRST_STEP", "LOSS_EVENTS", "Ledger", "SNAPSHOT", "SnapshotFigures", "TIERS", "failure_cause",
           "format_ledger", "free_parts", "ledger", "quarantined_versions", "restore_tier", "snapshot_figures",
           "spares_available", "uncovered"]
