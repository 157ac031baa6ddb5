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
    from ..recovery.timeline import format_table, phases, read_events

    events = read_events(args.path)
    if args.ledger:
        print(json.dumps(ledger(events, time.time()).as_dict(), indent=1))
        return 0
    rows = phases(events)
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    print(format_table(rows) if rows else "no hot-swaps recorded")
    print(format_ledger(ledger(events, time.time())))
    return 0
