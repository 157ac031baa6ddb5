"""Recovery timeline: JSON lines written by the launcher and the workers, and a per-phase view of them.

Phases of one hot-swap (generation g -> g+1), all wall-clock seconds:

- detect:    failure (fault injector's ``fault`` event, else the launcher's detection) -> launcher detection;
             ``reported_s``: -> the first survivor's report of a failed collective (``suspect``), when there was one
- agree:     detection -> the last rank has the new assignment and its process group (``pg_ready_at``)
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
    line = json.dumps(rec) + "\n"
    # One small O_APPEND write per event: lines from concurrent processes do not interleave.
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


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
        rec = {"generation": gen, "failed": g["failure"]["failed"],
               "replaced": g.get("assignment", {}).get("replaced"),
               "detect_s": detected - start,
               "reported_s": g["suspect"]["reported_at"] - start if "suspect" in g else None,
               "agree_s": (pg_ready - detected) if pg_ready else None,
               "rebuild_s": (engine_ready - pg_ready) if engine_ready and pg_ready else None,
               "restore_s": (restored - engine_ready) if restored and engine_ready else None,
               "recompute_s": (caught - restored) if caught and restored else None,
               "total_s": (caught - start) if caught else None,
               "survivor_pids": sorted(r["pid"] for r in surv), "spare_pids": sorted(r["pid"] for r in spares),
               "restored_version": max([r["restored_version"] or 0 for r in surv + spares], default=None)}
        out.append(rec)
    return out


def format_table(rows: list[dict[str, Any]]) -> str:
    head = (f"{'gen':>3} {'report':>7} {'detect':>7} {'agree':>7} {'rebuild':>8} {'restore':>8} {'recompute':>9} "
            f"{'total':>7}  replaced")
    lines = [head, "-" * len(head)]

    def fmt(v: Any) -> str:
        return f"{v:7.2f}" if isinstance(v, (int, float)) else f"{'-':>7}"

    for r in rows:
        lines.append(f"{r['generation']:>3} {fmt(r.get('reported_s'))} {fmt(r['detect_s'])} {fmt(r['agree_s'])} "
                     f"{fmt(r['rebuild_s']):>8} "
                     f"{fmt(r['restore_s']):>8} {fmt(r['recompute_s']):>9} {fmt(r['total_s'])}  {r['replaced']}")
    return "\n".join(lines)
