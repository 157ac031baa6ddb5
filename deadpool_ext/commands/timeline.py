"""``deadpool timeline TIMELINE.jsonl [--json]``: per-phase recovery durations of every hot-swap."""
from __future__ import annotations

import argparse
import json

HELP = "recovery phases (detect, agree, rebuild, restore, recompute) per hot-swap"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("path", help="the file given to deadpool-run --timeline")
    p.add_argument("--json", action="store_true", help="machine-readable output")


def run(args: argparse.Namespace) -> int:
    from ..recovery.timeline import format_table, phases, read_events

    rows = phases(read_events(args.path))
    print(json.dumps(rows, indent=1) if args.json else (format_table(rows) if rows else "no hot-swaps recorded"))
    return 0
