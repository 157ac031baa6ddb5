"""``deadpool timeline TIMELINE.jsonl [--json | --ledger]``: per-phase recovery durations of every hot-swap, and the
goodput ledger they add up to (``recovery/ledger.py``: what ``deadpool-run --metrics-port`` serves)."""
from __future__ import annotations

import argparse
import json
import time

HELP = "recovery phases (detect, agree, rebuild, restore, recompute) per hot-swap, and the goodput ledger"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("path", help="the file given to deadpool-run --timeline")
    p.add_argument("--json", action="store_true", help="machine-readable phases")
    p.add_argument("--ledger", action="store_true",
                   help="machine-readable goodput ledger (wall, productive and lost seconds by cause; a job still "
                        "running is counted up to now)")


def run(args: argparse.Namespace) -> int:
    from ..recovery.ledger import format_ledger, ledger
    from ..recovery.timeline import format_table, phases, read_events, spare_lines

    events = read_events(args.path)
    if args.ledger:
        print(json.dumps(ledger(events, time.time()).as_dict(), indent=1))
        return 0
    rows = phases(events)
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    print(format_table(rows) if rows else "no hot-swaps recorded")
    for line in spare_lines(events) + straggler_lines(events):
        print(line)
    print(format_ledger(ledger(events, time.time())))
    return 0


def straggler_lines(events: list[dict], most: int = 10) -> list[str]:
    """The straggler rule's namings (``launcher/straggler.py``), the last ``most`` of them, one line each."""
    named = [e for e in events if e.get("event") == "straggler"]
    out = [f"stragglers named: {len(named)}" + (f" (the last {most})" if len(named) > most else "")] if named else []
    t0 = next((float(e["time"]) for e in events if e.get("event") == "start"), None)
    for e in named[-most:]:
        at = f"+{float(e['time']) - t0:.1f} s" if t0 is not None else f"at {e.get('time')}"
        num = {k: (f"{float(e[k]):.1f}" if isinstance(e.get(k), (int, float)) else "?")
               for k in ("ratio", "window_s", "lost_s")}
        out.append(f"  {at}: node {e.get('node')} ({num['ratio']}x the others' median over {num['window_s']} s, "
                   f"{e.get('steps')} steps, the job waited {num['lost_s']} s): {e.get('decision')}, {e.get('why')}")
    return out
