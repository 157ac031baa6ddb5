"""Recovery timeline: JSON lines written by the launcher and the workers, and a per-phase view of them.

Phases of one hot-swap (generation g -> g+1), all wall-clock seconds:

- detect:    failure (fault injector's ``fault`` event, else the launcher's detection) -> launcher detection;
             ``reported_s``: -> the first survivor's report of a failed collective (``suspect``), when there was one
- agree:     detection -> the last rank has the new assignment and its process group (``pg_ready_at``), split in
  - assign:        detection -> the launcher published the next generation (its ``assignment`` event);
  - spare:         the assignment -> the spare is ready to join the survivors (``join_at``): its prologue (the
                   script up to its engine) and its engine build when it did not build ahead, else nearly nothing;
  - communicators: the later of the two -> every rank's groups joined the new generation (``pg_ready_at``)
  and, for the spare, ``spare_built_ahead`` with the prologue and engine build it did before the failure
  (``spare_ready``) or after the assignment (``spare_prologue_s``, ``spare_engine_s``)
- rebuild:   process group -> engine rebuilt on the new world (``engine_ready_at``), slowest rank
- restore:   engine -> state restored from tier 1 / tier 2 (``restored_at``), slowest rank
- recompute: restored -> the step that failed is completed again (``caught_up``)
"""
from __future__ import annotations

import json
import os
import time
from collections import defaultdict
from collections.abc import Iterable
from typing import Any


def write_event(**rec: Any) -> None:
    """Append one event to the job's timeline (``deadpool-run --timeline``); a no-op without one."""
    from ..launcher.contract import worker_env

    path = worker_env().timeline
    if not path:
        return
    rec.setdefault("time", time.time())
    rec.setdefault("source", "worker")
    rec.setdefault("pid", os.getpid())
    line = json.dumps(rec) + "\n"
    # One small O_APPEND write per event: lines from concurrent processes do not interleave.
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


def write_refusal(exc: BaseException, *, exit_status: int) -> None:
    """The ``refused`` event of a process that stops on a bad config, flag or attach (``ConfigError``): the error's
    class, the key or flag it names (``ConfigError.key``), who built an unattached engine
    (``NotAttachedError.built_by``), and the exit status the process ends with."""
    extra = {name: getattr(exc, name) for name in ("key", "built_by") if getattr(exc, name, None) is not None}
    write_event(event="refused", error=type(exc).__name__, exit_status=exit_status, **extra)


def read_events(path: str) -> list[dict[str, Any]]:
    with open(path) as fh:
        return [json.loads(line) for line in fh if line.strip()]


def phases(events: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """One record per generation change with per-phase durations."""
    events = list(events)
    by_gen: dict[int, dict[str, Any]] = defaultdict(lambda: {"recover": [], "caught_up": []})
    for e in events:
        kind = e.get("event")
        if kind == "failure":
            by_gen[e["generation"] + 1]["failure"] = e
        elif kind == "fault":
            by_gen[e.get("generation", 0) + 1].setdefault("fault", e)
        elif kind == "assignment":
            by_gen[e["generation"]]["assignment"] = e
        elif kind == "recover":
            by_gen[e["generation"]]["recover"].append(e)
        elif kind == "suspect":
            by_gen[e["generation"] + 1].setdefault("suspect", e)
        elif kind == "caught_up":
            by_gen[e.get("generation", max(by_gen) if by_gen else 1)]["caught_up"].append(e)
    out = []
    for gen in sorted(g for g in by_gen if "failure" in by_gen[g]):
        g = by_gen[gen]
        detected = g["failure"]["detected_at"]
        start = g["fault"]["time"] if "fault" in g else detected
        surv = [r for r in g["recover"] if r.get("role") == "survivor"]
        spares = [r for r in g["recover"] if r.get("role") == "spare"]
        pg_ready = max([r["pg_ready_at"] for r in surv], default=None)
        engine_ready = max([r["engine_ready_at"] for r in surv], default=None)
        restored = max([r["restored_at"] for r in surv + spares], default=None)
        caught = max([c["time"] for c in g["caught_up"]], default=None)
        assigned = g.get("assignment", {}).get("time")
        spare = spares[0] if spares else {}
        join_at = spare.get("join_at")
        prologue, engine = spare.get("prologue_s"), spare.get("engine_s")
        if not spare.get("built_ahead") and assigned and join_at and spare.get("engine_started_at"):
            # built after the assignment: from the launcher's publication (a process started again included)
            prologue, engine = spare["engine_started_at"] - assigned, join_at - spare["engine_started_at"]
        live = max([r["pg_ready_at"] for r in surv] + [s["pg_ready_at"] for s in spares if "pg_ready_at" in s],
                   default=None)
        rec = {"generation": gen, "failed": g["failure"]["failed"],
               "replaced": g.get("assignment", {}).get("replaced"),
               "detect_s": detected - start,
               "reported_s": g["suspect"]["reported_at"] - start if "suspect" in g else None,
               "agree_s": (pg_ready - detected) if pg_ready else None,
               "assign_s": (assigned - detected) if assigned else None,
               "spare_s": (join_at - assigned) if join_at and assigned else None,
               "communicators_s": (live - max(assigned, join_at)) if live and assigned and join_at else None,
               "spare_built_ahead": spare.get("built_ahead"), "spare_relabelled_from": spare.get("relabelled_from"),
               "spare_prologue_s": prologue, "spare_engine_s": engine,
               "rebuild_s": (engine_ready - pg_ready) if engine_ready and pg_ready else None,
               "restore_s": (restored - engine_ready) if restored and engine_ready else None,
               "recompute_s": (caught - restored) if caught and restored else None,
               "total_s": (caught - start) if caught else None,
               "survivor_pids": sorted(r["pid"] for r in surv), "spare_pids": sorted(r["pid"] for r in spares),
               "restored_version": max([r["restored_version"] or 0 for r in surv + spares], default=None)}
        out.append(rec)
    return out


def spare_lines(events: Iterable[dict[str, Any]]) -> list[str]:
    """Each spare's life (its ``spare_state`` events, ``rebuild/spare.py``), one line per spare: the states in order,
    each with its time since the spare's first state and, for the last one, why."""
    by_worker: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for e in events:
        if e.get("event") == "spare_state":
            by_worker[str(e.get("worker"))].append(e)
    out = []
    for worker, states in sorted(by_worker.items()):
        t0 = float(states[0]["time"])
        path = [str(states[0].get("previous"))]
        for e in states:
            if e.get("previous") != path[-1].split(" ")[0]:  # a new process (started again): its first state
                path.append(f"| {e.get('previous')}")
            path.append(f"{e.get('state')} (+{float(e['time']) - t0:.1f} s)")
        out.append(f"spare {worker}: {' -> '.join(path)}; {states[-1].get('why')}")
    return out


def format_table(rows: list[dict[str, Any]]) -> str:
    """The phases, one generation per line; ``agree`` is shown as its parts (assign, spare, comms), and the spare's
    prologue and engine build, with whether they happened before the failure (``ahead``) or after it, and the rank
    it built for when it relabelled its engine for another (``from r1``)."""
    head = (f"{'gen':>3} {'report':>7} {'detect':>7} {'assign':>7} {'spare':>7} {'comms':>7} {'rebuild':>8} "
            f"{'restore':>8} {'recompute':>9} {'total':>7}  spare's prologue + engine     replaced")
    lines = [head, "-" * len(head)]

    def fmt(v: Any) -> str:
        return f"{v:7.2f}" if isinstance(v, (int, float)) else f"{'-':>7}"

    for r in rows:
        ahead = r.get("spare_built_ahead")
        build = ("" if r.get("spare_prologue_s") is None else
                 f"{r['spare_prologue_s']:.2f} + {r.get('spare_engine_s') or 0:.2f} s "
                 f"{'ahead' if ahead else 'after'}"
                 + ("" if r.get("spare_relabelled_from") is None else f", from r{r['spare_relabelled_from']}"))
        lines.append(f"{r['generation']:>3} {fmt(r.get('reported_s'))} {fmt(r['detect_s'])} {fmt(r.get('assign_s'))} "
                     f"{fmt(r.get('spare_s'))} {fmt(r.get('communicators_s'))} {fmt(r['rebuild_s']):>8} "
                     f"{fmt(r['restore_s']):>8} {fmt(r['recompute_s']):>9} {fmt(r['total_s'])}  {build:<28} "
                     f"{r['replaced']}")
    return "\n".join(lines)
